"""What a Client keeps to take a new session by itself after a broker restart.

The broker's control connection is watched with a ZeroMQ socket monitor (``Client._broker_link``): when it
drops, the broker is gone, so requests in flight fail ``WorkerDied`` and the links go; when it connects again,
the client runs the handshake anew and swaps in the new ring, token and links (``Client._take_session``). It
keeps its slots, rows and model plans, so the new session must match them (``session.rejoin_mismatch``).
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY_S = 1.0  # a handshake that failed (the broker still loading its models, say) is tried again after this


@dataclass
class Rejoin:
    """The HELLO a new session repeats, and where the client stands. Read and written by the IO thread; a
    request only reads ``lost``."""

    n_slots: int
    max_items: int
    name: str
    timeout: float  # the handshake's, as Client(connect_timeout=...)
    lost: bool = False  # the broker's connection dropped: no session until a handshake succeeds
    connected: bool = True  # the control socket is connected (the broker listens)
    retry_at: float = 0.0  # time.monotonic() of the next attempt while lost and connected
    refused: str = ""  # why the last attempt failed, for the log and for readiness
