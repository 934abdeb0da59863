"""shmbroker's client library: ``Client`` (threads and futures) and ``AsyncClient`` (asyncio, uvloop)."""

from shmbroker.client.aio import AsyncClient, AsyncRequest
from shmbroker.client.client import Client
from shmbroker.client.errors import (
    BadImage,
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
from shmbroker.client.request import Request

__all__ = [
    "AsyncClient",
    "AsyncRequest",
    "BadImage",
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
