"""The settings of one HTTP front-end process; a module of its own so that the CLI imports no server code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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
    api_key: str = field(default="", repr=False)  # '': no key asked for; else 'Authorization: Bearer <api_key>'
