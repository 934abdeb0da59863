"""The client's exceptions. A per-request failure carries its code; a dead worker is always WorkerDied."""

from __future__ import annotations

from shmbroker.broker.common.protocol import Status


class ShmBrokerError(Exception):
    """Base of every shmbroker error; ``code`` is the protocol's name for it."""

    code: str = "ERROR"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class HandshakeError(ShmBrokerError):
    """The session could not be set up (broker absent, refused the HELLO, or a step timed out)."""

    code = "HANDSHAKE"


class NoBroker(HandshakeError):
    """No broker listens on the runtime directory; the message names it and how it was chosen."""

    code = "NO_BROKER"


class ClientClosed(ShmBrokerError):
    """The client was closed: a request made after ``close()`` began, or one still unanswered when its wait ended."""

    code = "CLIENT_CLOSED"


class RequestError(ShmBrokerError):
    """One request failed; other requests and the session are unaffected."""

    code = "INTERNAL"


class RequestTimeout(RequestError, TimeoutError):
    code = "TIMEOUT"


class Overloaded(RequestError):
    code = "OVERLOADED"


class BadInput(RequestError, ValueError):
    """The request's inputs do not fit the model or the slot; ``code`` says which check (BAD_DTYPE, ...)."""

    code = "BAD_INPUT"


class BadImage(BadInput):
    """A row of a request of encoded images could not be used: not a JPEG or PNG, corrupt, truncated, or over a
    limit of the model (``max_image_pixels``); the message names the row and why. Other requests are unaffected."""

    code = "BAD_IMAGE"


class UnknownModel(RequestError, KeyError):
    code = "UNKNOWN_MODEL"

    def __str__(self) -> str:  # KeyError would quote the message
        return f"{self.code}: {self.message}"


class WorkerDied(ShmBrokerError):
    """The worker running the request died, or no live worker serves the model right now."""

    code = "WORKER_DIED"


_BAD_INPUT = {Status.BAD_INPUT, Status.BAD_DTYPE, Status.BAD_SHAPE, Status.BAD_SIZE, Status.BAD_SLOT,
              Status.STALE_GENERATION, Status.BAD_SESSION}


def from_status(status: int, message: str) -> ShmBrokerError:
    """The exception for a DONE result's status."""
    try:
        st = Status(status)
    except ValueError:
        return RequestError(f"unknown status {status}: {message}")
    if st is Status.TIMEOUT:
        return RequestTimeout(message)
    if st is Status.OVERLOADED:
        return Overloaded(message)
    if st is Status.UNKNOWN_MODEL:
        return UnknownModel(message)
    if st is Status.WORKER_DIED or st is Status.SHUTTING_DOWN:
        return WorkerDied(message, st.name)
    if st is Status.BAD_IMAGE:
        return BadImage(message)
    if st in _BAD_INPUT:
        return BadInput(message, st.name)
    return RequestError(message, st.name)
