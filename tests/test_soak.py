"""Soak (bench/RESULTS.md#reliability, item 8): ten minutes at 80 % of the measured capacity, behind ``-m soak``.

Four client processes offer ``tiny`` requests in open loop at 80 % of the closed-loop capacity measured
first, while a fifth opens and closes a session every 0.2 s. Sampled every 10 s: RSS and open file
descriptors of the broker and its worker, and the rings they hold. Pass: RSS grows less than 5 % from the
first sample after warm-up to the end, descriptors stay flat, no ring is held beyond the live sessions during
the run and none once every client has left; every request is accounted for.

``SHMB_SOAK_S`` shortens the run (default 600 s) for a trial.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import TINY_MODELS, start_broker
from tests.faultload import SPAWN, LoadGroup, LoadSpec, assert_accounted, churn_sessions

SOAK_S = float(os.environ.get("SHMB_SOAK_S", "600"))
WARMUP_S = 60.0  # RSS settles (allocator arenas, caches) before the baseline sample
PROCS = 4
FDS_PER_SESSION = 16  # descriptors one session holds in the broker and the worker, with room to spare


def usage(pids: list[int]) -> tuple[int, int]:
    procs = [psutil.Process(p) for p in pids]
    return sum(p.memory_info().rss for p in procs), sum(p.num_fds() for p in procs)


@pytest.mark.soak
@pytest.mark.timeout(1500)  # ten minutes of load plus the capacity run and the set-up
def test_soak_at_80_percent(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", models=TINY_MODELS)
    try:
        probe = LoadGroup([LoadSpec(b.runtime_dir, in_flight=8, slots=8, seed=i) for i in range(PROCS)])
        time.sleep(5.0)  # the capacity window
        cap = probe.finish()
        capacity = cap.ok / 5.0
        rate = 0.8 * capacity
        # room to catch up after a stall: an open-loop sender capped at the probe's 8 in flight falls behind
        group = LoadGroup([LoadSpec(b.runtime_dir, in_flight=32, slots=32, rate_per_s=rate / PROCS, seed=i,
                                    timeout_s=2.0) for i in range(PROCS)])
        stop, out = SPAWN.Event(), SPAWN.Queue()
        churn = SPAWN.Process(target=churn_sessions, args=(b.runtime_dir, stop, out), daemon=True)
        churn.start()
        pids = [b.proc.pid, *b.worker_pids()]
        samples: list[tuple[float, int, int, int]] = []
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < SOAK_S:
            rss, fds = usage(pids)
            samples.append((elapsed, rss, fds, len(b.segments())))
            time.sleep(10.0)  # the sampling period
        rss_end, fds_end = usage(pids)  # still under load, like every sample
        stop.set()
        sessions, churn_errors = out.get(timeout=60)
        t = group.finish()
        base = next((s for s in samples if s[0] >= min(WARMUP_S, SOAK_S / 4)), samples[0])
        growth = (rss_end - base[1]) / base[1]
        print(f"soak {SOAK_S:.0f} s: capacity {capacity:.0f}/s, offered {t.offered_per_s:.0f}/s "
              f"({100 * t.offered_per_s / capacity:.1f} %), served {t.ok / SOAK_S:.0f}/s, {t.submitted} "
              f"submitted, {t.ok} ok, failed {t.failed}; {sessions} sessions opened and closed "
              f"({churn_errors} errors); RSS broker+worker {base[1] >> 20} -> {rss_end >> 20} MiB "
              f"({100 * growth:+.2f} %), fds {base[2]} -> {fds_end} (max {max(s[2] for s in samples)}), "
              f"segments max {max(s[3] for s in samples)}")
        assert_accounted(t)
        # the senders share the cores with the worker; a busy machine may cost them a little of the 80 %
        assert t.offered_per_s >= 0.75 * capacity, "the load generator could not offer the load"
        assert t.failed_total <= 0.001 * t.submitted, t.failed
        assert churn_errors == 0 and sessions > 0
        assert growth < 0.05, f"RSS grew {100 * growth:.1f} %"
        # flat: a sample may catch the churner's session open (its segment, sockets and connections)
        assert max(s[2] for s in samples if s[0] >= base[0]) - base[2] <= FDS_PER_SESSION
        assert fds_end - base[2] <= FDS_PER_SESSION
        assert max(s[3] for s in samples) <= PROCS + 1  # the load's sessions and the churner's one
    finally:
        assert b.stop_released() == 0, b.log()
