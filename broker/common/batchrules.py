"""The batching-rule table: every rule a model may name in ``models.NAME.batching``, in one place.

Config validation and the worker's batcher (``gpu_worker.batching.BatchPolicy.new_rule``) read it. A row names
the rule's class by import path, so that reading the table loads no worker code. Adding a rule is one class (a
``gpu_worker.batching.BatchingRule``) and one row: here for the built-in ones, or an entry point of group
``shmbroker.batching`` whose object is a ``RuleEntry`` (an installed plugin package; docs/ARCHITECTURE.md,
"Add a batching rule").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from shmbroker.broker.common.tables import choices, load_target, with_plugins

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
        return load_target(self, "batching rule")


_B = "shmbroker.gpu_worker.batching"
BUILTIN: tuple[RuleEntry, ...] = (
    RuleEntry("idle", f"{_B}:IdleDispatch",
              "Triton's rule, and a batch leaves at once while an executor of the model would sit idle"),
    RuleEntry("triton", f"{_B}:TritonRule",
              "every batch waits for max_batch rows, a preferred size or max_queue_delay_us"),
)

@functools.cache
def rule_table() -> dict[str, RuleEntry]:
    """The built-in rules, then those of installed plugins (a plugin cannot replace a built-in one)."""
    return with_plugins(BUILTIN, ENTRY_POINT_GROUP, RuleEntry, "batching rule")


def choices_text() -> str:
    """The rule names as an error message lists them."""
    return choices(rule_table())
