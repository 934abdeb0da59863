"""Extension tables: the built-in rows of a table (engines, batching rules) and the rows installed plugins add
through an entry point group, each row naming its class by import path so that reading a table loads nothing
else."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from importlib import metadata
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


class Row(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def target(self) -> str:  # "module:Class"
        ...


R = TypeVar("R", bound=Row)


def load_target(row: Row, what: str) -> Any:
    """The class a row names; ImportError (naming ``what`` and the row) when its module or class is missing."""
    module, _, attr = row.target.partition(":")
    cls = getattr(importlib.import_module(module), attr, None)
    if cls is None:
        raise ImportError(f"{what} {row.name!r}: {module} has no {attr}")
    return cls


def with_plugins(builtin: Iterable[R], group: str, row_type: type[R], what: str) -> dict[str, R]:
    """The built-in rows, then those of the installed plugins' entry points of ``group`` (each object a
    ``row_type`` of the entry point's name); a broken plugin, or one that would replace a built-in row, is
    logged and left out, never fatal."""
    table = {r.name: r for r in builtin}
    builtin_names = frozenset(table)
    for ep in metadata.entry_points(group=group):
        try:
            row = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is logged and left out
            log.error("%s plugin %s (%s) cannot be loaded: %s", what, ep.name, ep.value, exc)
            continue
        if not isinstance(row, row_type) or row.name != ep.name or row.name in builtin_names:
            log.error("%s plugin %s (%s) is not a %s of that name, or shadows a built-in one", what, ep.name,
                      ep.value, row_type.__name__)
            continue
        table[row.name] = row
    return table


def choices(table: dict[str, Any]) -> str:
    """A table's names as an error message lists them."""
    return ", ".join(repr(n) for n in table)
