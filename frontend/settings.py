"""The settings of one HTTP front-end process; a module of its own so that the CLI imports no server code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Open files a front-end process needs beside its --max-connections client connections: its own (the listening
# socket, the ring session's ZeroMQ sockets, about 5 for each worker, the executor's questions to the broker, the
# log: about 40 with two workers) and those it closes in one loop turn, freed at the next (16 at most).
OWN_FDS = 64
RATE_WINDOW_S = 10.0  # how far a request body may fall behind min_body_rate_kib, or run ahead of it, in seconds


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    runtime_dir: Path
    unix: str = ""  # a Unix socket's path, listened on instead of host:port
    slots: int = 0  # ring slots of this process's session: its requests in flight (0: the broker's default)
    max_items: int = 0  # rows a slot holds (0: the broker's default); larger requests are sent as parts
    max_body_mib: int = 64
    connect_timeout_s: float = 10.0
    header_timeout_s: float = 10.0  # to send a request's headers, from the opening or the first byte after a reply
    body_timeout_s: float = 60.0  # to send a whole body, from its headers
    max_connections: int = 512  # per process
    body_memory_mib: int = 512  # request bodies one process holds at once
    peer_body_memory_mib: int = 128  # of which one peer's (an IP address, an IPv6 /64, a Unix socket's uid)
    min_body_rate_kib: int = 64  # KiB/s a body must keep up (frontend/limits.py); 0: only body_timeout_s
    api_key: str = field(default="", repr=False)  # '': no key asked for; else 'Authorization: Bearer <api_key>'
