"""The start-up check that /dev/shm can hold the rings the configuration implies.

Rings are reserved in full with ``posix_fallocate`` when a session starts, so a full /dev/shm never
causes a SIGBUS later; it makes HELLO fail with NO_SHM. This check catches the common deployment
mistake earlier: Docker's default /dev/shm of 64 MiB, say, with models whose slots are megabytes. It runs
once, when the first worker has reported its models (slot sizes depend on their tensor shapes), before
any session is served, and the broker refuses to start with a message naming the bytes and the setting.
"""

from __future__ import annotations

import os

from broker import protocol as P
from broker.config import Config
from broker.ring import SHM_DIR, RingLayout
from broker.sessions import capacities, session_rows


def ring_bytes(cfg: Config, models: list[P.ModelInfo]) -> int:
    """Bytes of one ring of the configured default size (``default_slots`` x ``default_max_items`` rows)."""
    in_cap, out_cap = capacities(models, session_rows(0, cfg.sessions.default_max_items, models))
    return RingLayout(0, cfg.sessions.default_slots, in_cap, out_cap).total_bytes


def free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check(cfg: Config, models: list[P.ModelInfo], shm_dir: str = SHM_DIR) -> str | None:
    """None when ``shm_dir`` has room for ``sessions.reserve_sessions`` default rings, else the error text."""
    one = ring_bytes(cfg, models)
    need = one * cfg.sessions.reserve_sessions
    free = free_bytes(shm_dir)
    if free >= need:
        return None
    mib = -(-need // (1 << 20))
    return (
        f"{shm_dir} has {free} bytes free, but the configuration needs {need} bytes ({mib} MiB): "
        f"sessions.reserve_sessions = {cfg.sessions.reserve_sessions} ring(s) of {one} bytes "
        f"(sessions.default_slots = {cfg.sessions.default_slots} slots sized for "
        f"sessions.default_max_items = {session_rows(0, cfg.sessions.default_max_items, models)} rows of models "
        f"{', '.join(m.name for m in models)}). Enlarge {shm_dir}: Docker `--shm-size={mib + 64}m` "
        f"(Kubernetes: an emptyDir with medium Memory and sizeLimit); on a host, the size= option of its tmpfs "
        f"mount (`systemctl edit dev-shm.mount`: [Mount] Options=size=..., or /etc/fstab); or lower those "
        f"[sessions] keys or the models' max_batch."
    )
