"""The batching-rule table: every rule a model may name in ``models.NAME.batching``, in one place.

Config validation and the worker's batcher (``gpu_worker.batching.BatchPolicy.new_rule``) read it. A row names
the rule's class by import path, so that reading the table loads no worker code. Adding a rule is one class (a
``gpu_worker.batching.BatchingRule``) and one row: here for the built-in ones, or an entry point of group
``shmbroker.batching`` whose object is a ``RuleEntry`` (an installed plugin package; docs/ARCHITECTURE.md,
"Add a batching rule").
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "shmbroker.batching"
DEFAULT = "idle"


@dataclass(frozen=True)
class RuleEntry:
    """One rule: its name in the config, its class as ``module:Class``, and a line of help."""

    name: str
    target: str
    summary: str

    def load_class(self) -> Any:
        """The rule class; ImportError (with the rule named) when its module or class is missing."""
        module, _, attr = self.target.partition(":")
        cls = getattr(importlib.import_module(module), attr, None)
        if cls is None:
            raise ImportError(f"batching rule {self.name!r}: {module} has no {attr}")
        return cls


_B = "shmbroker.gpu_worker.batching"
BUILTIN: tuple[RuleEntry, ...] = (
    RuleEntry("idle", f"{_B}:IdleDispatch",
              "Triton's rule, and a batch leaves at once while an executor of the model would sit idle"),
    RuleEntry("triton", f"{_B}:TritonRule",
              "every batch waits for max_batch rows, a preferred size or max_queue_delay_us"),
)

BUILTIN_NAMES = frozenset(e.name for e in BUILTIN)


@functools.cache
def rule_table() -> dict[str, RuleEntry]:
    """The built-in rules, then those of installed plugins (a plugin cannot replace a built-in one)."""
    table = {e.name: e for e in BUILTIN}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is logged and left out, never fatal
            log.error("batching rule plugin %s (%s) cannot be loaded: %s", ep.name, ep.value, exc)
            continue
        if not isinstance(entry, RuleEntry) or entry.name != ep.name or entry.name in BUILTIN_NAMES:
            log.error("batching rule plugin %s (%s) is not a RuleEntry of that name, or shadows a built-in rule",
                      ep.name, ep.value)
            continue
        table[entry.name] = entry
    return table


def choices_text() -> str:
    """The rule names as an error message lists them."""
    return ", ".join(repr(n) for n in rule_table())
