"""shmbroker: a node-local, multiprocess, shared-memory inference broker.

The client API is here (``from shmbroker import Client, AsyncClient``); the roles live in subpackages:
``shmbroker.broker`` (the control plane and the command line), ``shmbroker.gpu_worker`` (one worker per
device), ``shmbroker.client``, ``shmbroker.frontend`` (HTTP and inline front-ends) and ``shmbroker.bench``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

# another `shmbroker` on sys.path (an installed wheel) serves what this folder lacks: a copy of the checkout
# whose links to the role folders were not kept
__path__ = pkgutil.extend_path(__path__, __name__)

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
