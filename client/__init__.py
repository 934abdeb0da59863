"""shmbroker's client library: ``Client`` (threads and futures) and ``AsyncClient`` (asyncio, uvloop)."""

from client.aio import AsyncClient
from client.client import Client, Request
from client.errors import (
    BadInput,
    HandshakeError,
    Overloaded,
    RequestError,
    RequestTimeout,
    ShmBrokerError,
    UnknownModel,
    WorkerDied,
)

__all__ = [
    "AsyncClient",
    "BadInput",
    "Client",
    "HandshakeError",
    "Overloaded",
    "Request",
    "RequestError",
    "RequestTimeout",
    "ShmBrokerError",
    "UnknownModel",
    "WorkerDied",
]
