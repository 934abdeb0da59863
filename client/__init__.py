"""shmbroker's client library: ``Client`` (threads and futures) and ``AsyncClient`` (asyncio, uvloop)."""

from client.aio import AsyncClient
from client.client import Client
from client.errors import (
    BadInput,
    ClientClosed,
    HandshakeError,
    NoBroker,
    Overloaded,
    RequestError,
    RequestTimeout,
    ShmBrokerError,
    UnknownModel,
    WorkerDied,
)
from client.request import Request

__all__ = [
    "AsyncClient",
    "BadInput",
    "Client",
    "ClientClosed",
    "HandshakeError",
    "NoBroker",
    "Overloaded",
    "Request",
    "RequestError",
    "RequestTimeout",
    "ShmBrokerError",
    "UnknownModel",
    "WorkerDied",
]
