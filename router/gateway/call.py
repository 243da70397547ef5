"""One client request as the gateway carries it, from dispatch to its last attempt: one object, not ten arguments.

A `Call` is made once per inference request (and per request for a stored
response) when its body has been read, and passed whole to the retry chain,
the hold and each attempt. It keeps the three names a request has apart:
`requested`, the name the client sent (an alias, perhaps); `model`, the model
that name leads to; and, per attempt, the `target` tried, which a fallback
makes another model still (the body it is sent under is `body_for(target)`,
written once per target). A request naming a LoRA adapter has the adapter as
`requested` and `adapter`, and its base model as `model`. What the access log says of the request is its
`entry`, None when there is no access log. `metered`: its answer's tokens are
counted (router.gateway.tokens); not a stored response read again.
"""

from __future__ import annotations

from typing import Any

from router.core.config.tenants import Caller
from router.core.pool.waiters import Charge
from router.gateway.access_log import Entry
from router.gateway.bodies import with_model
from router.gateway.tokens import Tokens
from router.http.messages import Request
from router.http.writer import Writer


class Call:
    """A request, its writer, what its body says, whose it is, and the line the access log will write."""

    __slots__ = (
        "_bodies",
        "adapter",
        "caller",
        "charge",
        "entry",
        "headers",
        "metered",
        "model",
        "parsed",
        "request",
        "requested",
        "sent",
        "started",
        "stream",
        "usage",
        "writer",
    )

    def __init__(  # noqa: PLR0917 (a value object: its fields in order, made on the request path)
        self,
        request: Request,
        writer: Writer,
        parsed: dict[str, Any],
        requested: str,
        model: str,
        stream: bool,
        headers: bytes,
        entry: Entry | None,
        caller: Caller,
        adapter: str | None,
        started: float,
    ) -> None:
        # Every field given, none defaulted or tested: this runs once per request.
        self.request = request
        self.writer = writer
        # The body as JSON (or a multipart form's fields): only `model` and `stream` are read here.
        self.parsed = parsed
        self.requested = requested
        self.model = model
        self.stream = stream
        # The client's headers as the replica gets them, framed once for every attempt.
        self.headers = headers
        self.entry = entry
        # Whose request it is: its key's tenant and priority class.
        self.caller = caller
        # The LoRA adapter it names, served by replicas of `model` that list it
        # (router.core.pool.adapters): sent as the client wrote it, under the adapter's name.
        self.adapter = adapter
        # The body under each other model's name it was sent to (an alias's model, a fallback;
        # an adapter's base model gets the client's own bytes): made by body_for() when first asked.
        self._bodies: dict[str, bytes] | None = None
        # When it arrived (time.perf_counter()): a stream's time to first token runs from here.
        self.started = started
        self.metered = True
        # With fairness_unit = "tokens", once it waited: its cost to its tenant's turn (router.gateway.chain).
        self.charge: Charge | None = None
        # What its answer said it took, once read (Ledgers.tokens): a rate limit's settlement reads it.
        self.usage: Tokens | None = None
        # Sent to a replica, as far as the router knows (an attempt began): one the client left
        # before its answer may still have cost the engine its work.
        self.sent = False

    def body_for(self, target: str) -> bytes:
        """The body as `target` must get it: the client's own bytes, or re-encoded under `target`'s name
        (engines refuse a name they do not serve), once per target however many replicas are tried."""
        if target == self.requested:
            return self.request.body
        bodies = self._bodies
        if bodies is None:
            bodies = self._bodies = {}
        body = bodies.get(target)
        if body is None:
            if target == self.model and self.adapter is not None:
                # An adapter's base model is sent the client's own bytes, under the adapter's name.
                body = self.request.body
            else:
                body = with_model(self.request.body, self.parsed, target)
            bodies[target] = body
        return body
