"""How one model's requests become batches: the policy (built once from the model's config section) and the rules
it names (``models.NAME.batching``, a row of ``broker.common.batchrules``).

A rule says when the queued rows make a batch due whatever ``max_queue_delay_us`` says, and how many rows a
batch takes; the batcher (``gpu_worker.batcher``) owns the queue, the delay, the deadlines and the device's
trims. Adding a rule is one ``BatchingRule`` subclass and one table row (docs/ARCHITECTURE.md, "Add a batching
rule").
"""

from __future__ import annotations

from dataclasses import dataclass

from shmbroker.broker.common.batchrules import DEFAULT, choices_text, rule_table
from shmbroker.broker.common.config import ModelSection


@dataclass(frozen=True)
class BatchPolicy:
    """One model's batching: its rule and sizes, and how its batches share a GPU.

    ``executors``: the batches of the model that run at once without waiting for each other (a host engine's
    instances; 1 for a device, whose stream slots share it). The GPU keys (``serial_compute`` to
    ``early_copies``, docs/ARCHITECTURE.md, Configuration) matter only to a device runner; ``by_session``
    (``batch_by_session``) to every runner.
    """

    max_batch: int
    max_queue_delay_us: int = 1000
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 256
    batching: str = DEFAULT
    executors: int = 1
    serial_compute: bool = True
    fill_while_busy: bool = True
    trim_to_sizes: bool = True
    early_copies: bool = False
    by_session: bool = False

    @classmethod
    def from_config(cls, mc: ModelSection, device: bool) -> BatchPolicy:
        """The policy of a model's config section; ``device``: its engine runs on a GPU (one executor)."""
        return cls(mc.max_batch, mc.max_queue_delay_us, tuple(mc.preferred_batch_sizes), mc.max_queue_size,
                   mc.batching, 1 if device else mc.instances, mc.serial_compute, mc.fill_while_busy,
                   mc.trim_to_sizes, mc.early_copies, mc.batch_by_session)

    @property
    def early(self) -> bool:
        """A batch opened while the device computes has its rows copied to the device as they come."""
        return self.fill_while_busy and self.early_copies

    def new_rule(self) -> BatchingRule:
        """The rule ``batching`` names, from the table, made for this policy."""
        entry = rule_table().get(self.batching)
        if entry is None:
            raise ValueError(f"unknown batching rule {self.batching!r}: expected one of {choices_text()}")
        rule: BatchingRule = entry.load_class()(self)
        return rule


class BatchingRule:
    """When queued rows make a batch due at once, and how many rows it takes. The batcher calls these under its
    lock, on every put and take: keep them to a few comparisons, and keep no state but the policy's."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.max_batch = policy.max_batch
        self.preferred = sorted(set(policy.preferred_batch_sizes))

    def at_once(self, rows: int, running: int) -> bool:
        """Whether a batch is due now, without waiting out the delay: ``rows`` queued, ``running`` batches of
        the model handed out and not done. Otherwise it is due once the oldest request waited the delay."""
        raise NotImplementedError

    def size(self, rows: int) -> int:
        """How many of the ``rows`` queued a due batch takes (at most; the device may take fewer)."""
        raise NotImplementedError

    def freed(self, running: int) -> bool:
        """A batch ended, ``running`` still run: whether a batch that waits for the delay may be due at once now
        (the batcher then wakes its taker). None may, unless ``at_once`` reads ``running``."""
        return False


class TritonRule(BatchingRule):
    """Triton's: a batch is due at ``max_batch`` rows or the smallest preferred size, else once the oldest
    request waited ``max_queue_delay_us``; it takes the largest preferred size its rows reach, or all."""

    def __init__(self, policy: BatchPolicy) -> None:
        super().__init__(policy)
        self.due_rows = min(self.preferred[0], self.max_batch) if self.preferred else self.max_batch

    def at_once(self, rows: int, running: int) -> bool:
        return rows >= self.due_rows

    def size(self, rows: int) -> int:
        if rows < self.max_batch:
            for p in reversed(self.preferred):
                if p <= rows:
                    return p
        return self.max_batch


class IdleDispatch(TritonRule):
    """Triton's, and a batch also leaves at once while fewer than ``executors`` batches run: an executor would
    otherwise sit idle while its requests wait (bench/RESULTS.md#idle-dispatch)."""

    def __init__(self, policy: BatchPolicy) -> None:
        super().__init__(policy)
        self.idle_below = policy.executors

    def at_once(self, rows: int, running: int) -> bool:
        return running < self.idle_below or rows >= self.due_rows

    def freed(self, running: int) -> bool:
        return running == self.idle_below - 1
