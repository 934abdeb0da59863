"""shmbroker: a node-local, multiprocess, shared-memory inference broker.

The client API is here (``from shmbroker import Client, AsyncClient``); the roles live in subpackages:
``shmbroker.broker`` (the control plane and the command line), ``shmbroker.gpu_worker`` (one worker per
device), ``shmbroker.client``, ``shmbroker.frontend`` (HTTP and inline front-ends) and ``shmbroker.bench``.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if not os.path.isfile(os.path.join(__path__[0], "broker", "__init__.py")):
    # a copy of the checkout whose links to the role folders were lost: it must not run another install's code
    raise ImportError(f"{__path__[0]} lacks its links to the role folders (shmbroker/broker -> ../broker, ...): "
                      "restore them (git checkout with core.symlinks = true), or install the wheel")

from shmbroker.broker import __version__ as __version__

if TYPE_CHECKING:  # the client API with its types, for type checkers; at run time __getattr__ loads it
    from shmbroker.client import *  # noqa: F403


if not TYPE_CHECKING:  # type checkers see the names above; a misspelt one stays an error for them

    def __getattr__(name: str) -> Any:
        """The client API (``shmbroker.client.__all__``), imported on first use: ``shmbroker serve`` and the workers
        never load the client."""
        client = importlib.import_module("shmbroker.client")
        if name in client.__all__:
            return getattr(client, name)
        raise AttributeError(f"module 'shmbroker' has no attribute {name!r}")
