"""How a handler answers, whatever the transport: the Writer it is given, and what it may count.

A handler gets one Writer per request and answers through it alone: either
`answer(reply)` (a whole answer, one write) or a stream: `start()`, then
`write()` each piece (True: the client's buffer is full, `await drain()`),
then `end()`, or `abort()` when the source broke off. The framing rules are
the writer's, whatever the handler does (router/http/server/writer.py for
HTTP/1.1): a second transport would be a second writer, with no change in
the handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from router.http.messages import Reply, Request
from router.http.pipe import Pipe


class WriteStalled(ConnectionResetError):
    """The client took no bytes of its answer for the write-stall timeout: cut off."""


class Meter(Protocol):
    """What a writer counts of its answer for whoever watches it (the gateway's access log)."""

    status: int
    bytes_out: int


class Writer(Protocol):
    """One request's answer, as its handler sees it."""

    # Whoever counts this answer, if anyone: the writer fills in its status and bytes written.
    meter: Meter | None

    @property
    def started(self) -> bool:
        """Whether anything of the answer was written: past this, no other answer can be given."""

    def answer(self, reply: Reply) -> None:
        """The whole answer, at once."""

    def start(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], *, length: int | None = None
    ) -> None:
        """The head of a streamed answer; `length` when the body's size is known."""

    def write(self, data: bytes) -> bool:
        """One piece of the body; True when the client's buffer is full (await drain())."""

    def body_sink(self) -> Callable[[bytes], bool]:
        """write(), made for this stream: what a stream's source calls per piece."""

    def end(self) -> None:
        """The body is complete."""

    def abort(self, last_words: bytes = b"") -> None:
        """The answer broke off: `last_words` if any, then the connection closes without the answer's end."""

    def close_after(self) -> None:
        """Close the connection once this answer is out."""

    async def drain(self) -> None:
        """Wait until the client took enough; WriteStalled when it takes nothing for too long."""

    def switch(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> Pipe | None:
        """Answer `status` (101) and hand the connection's bytes over, both ways: the Pipe; None when this
        request's connection cannot switch (the server's UpgradeCheck did not pass it), and nothing is written."""


Handler = Callable[[Request, Writer], Awaitable[None]]

# Judges a request by its head, before any of its body is read or a 100 sent
# (the app's API keys): a Reply refuses it. Called only for a head that announces
# a body, with the Request as it will be (its id and target) but no body yet.
HeadCheck = Callable[[Request], "Reply | None"]

# Whether a request that asks to switch protocols (an Upgrade, without a body) may be
# switched by its handler (Writer.switch): then nothing after its head is read as HTTP,
# and its connection ends with it. Called with the Request as it will be, no body.
UpgradeCheck = Callable[[Request], bool]
