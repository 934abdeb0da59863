"""The front-ends' commands: the CLI adds one ``shmbroker`` subcommand per module here.

Each module exposes ``NAME`` (the subcommand), ``HELP`` (its line in ``shmbroker -h``), ``add_arguments(ap)``
and ``command(args) -> int`` (the exit code), and imports nothing heavy at module level: every ``shmbroker``
command builds the whole parser. Adding a front-end is one such module and one entry of ``FRONTENDS``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType
from typing import Protocol, cast

from shmbroker.frontend import inline_cli
from shmbroker.frontend import main as http_main


class FrontendCommand(Protocol):
    """What the CLI needs of a front-end's command module."""

    NAME: str
    HELP: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    command: Callable[[argparse.Namespace], int]


def _command(module: ModuleType) -> FrontendCommand:
    return cast("FrontendCommand", module)


FRONTENDS: tuple[FrontendCommand, ...] = (_command(http_main), _command(inline_cli))
