"""The upstream client's errors: what went wrong with a replica, classified for the proxy's retry rules.

    ConnectFailed           no connection: nothing was sent
    HeadTimeout             no response head within the deadline
    ConnectionBroken        the connection ended or was garbled; `before_head`,
     |                      `answered` and `unsent` say how far the request and
     |                      its answer had gone (only an unsent request is sent again)
     +-- HeadTooLarge       the response head went past MAX_HEAD_BYTES
     +-- BodyTooLarge       an answer read whole went past the caller's limit
     +-- UpstreamIdle       the replica went silent in the middle of a body

A replica's HTTP status is never an exception here.
"""

from __future__ import annotations


class ConnectFailed(Exception):
    """No connection could be made: the request was not sent."""


class HeadTimeout(Exception):
    """The replica sent no response head within the deadline."""


class ConnectionBroken(Exception):
    """The connection ended or sent something that is not HTTP.

    `before_head`: no response head had been handed to the caller.
    `answered`: some bytes of an answer had arrived for this request, so the
    replica has seen it and may have acted on it: it must not be sent again.
    Unless given, `answered` is true exactly when the head had come.
    `unsent`: the connection ended while part of the request was still
    waiting to go out, or was reset (the replica's kernel saying it dropped
    bytes it never read), with nothing answered: the replica never had the
    whole request, so it cannot have acted on it. Only such a request may
    be sent again; one written whole and then met by a close may have been
    read, run, and crashed the replica (Go's transport retries a POST only
    on its `nothingWrittenError`; nginx passes a POST whose request was
    sent to no next server unless told `non_idempotent`).
    """

    def __init__(self, message: str, *, before_head: bool, answered: bool | None = None, unsent: bool = False) -> None:
        super().__init__(message)
        self.before_head = before_head
        self.answered = not before_head if answered is None else answered
        self.unsent = unsent


class HeadTooLarge(ConnectionBroken):
    """The replica's response head went past MAX_HEAD_BYTES."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=True, answered=True)


class BodyTooLarge(ConnectionBroken):
    """An answer read whole went past the caller's limit: never buffered without bound."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=False, answered=True)


class UpstreamIdle(ConnectionBroken):
    """The replica sent nothing for longer than the idle timeout in the middle of a body."""

    def __init__(self, message: str) -> None:
        super().__init__(message, before_head=False, answered=True)
