"""The client keys (`api_keys`): checked from a request's head, consumed, never forwarded; each names a tenant."""

from __future__ import annotations

import hashlib

from router.core.config.tenants import ANYONE, Caller, ClientKey, PriorityClass, callers
from router.core.errors import Unauthorized
from router.gateway.answers import error_response
from router.http.messages import Reply, Request

# What a client sends its key in: OpenAI's clients Authorization, Anthropic's X-Api-Key.
CLIENT_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})


class ApiKeys:
    """The client keys, by SHA-256: whose requests each makes; consumed, never forwarded."""

    def __init__(self, keys: tuple[ClientKey, ...], classes: tuple[PriorityClass, ...]) -> None:
        # Only the keys' digests are kept. A key is found by the digest of what
        # the client sent: how long that takes depends on the digest alone,
        # which says nothing of the key (no constant-time loop over every key
        # is needed, and a hundred tenants cost one lookup).
        self._callers = callers(keys, classes)
        self.active = bool(self._callers)
        # The router consumes the client's key; the replicas never see it. Anthropic's
        # clients send theirs as X-Api-Key.
        self.drop = CLIENT_KEY_HEADERS if self._callers else frozenset()

    def update(self, keys: tuple[ClientKey, ...], classes: tuple[PriorityClass, ...]) -> None:
        """SIGHUP: the keys now configured, all at once (no request sees half of them). A request
        already checked keeps the caller it was given: its tenant, class and weight to its end."""
        found = callers(keys, classes)
        self._callers = found
        self.active = bool(found)
        self.drop = CLIENT_KEY_HEADERS if found else frozenset()

    def check(self, request: Request) -> Caller:
        """Whose request it is, as its key says; Unauthorized without a known key (while keys are set)."""
        if not self._callers:
            return ANYONE
        header = (request.header(b"authorization") or b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if not header and (api_key := request.header(b"x-api-key")):
            # The Anthropic SDK's own header (its auth_token is sent as Bearer).
            scheme, given = "bearer", api_key.decode("latin-1")
        if scheme.lower() == "bearer" and given:
            caller = self._callers.get(hashlib.sha256(given.strip().encode("latin-1")).digest())
            if caller is not None:
                return caller
        raise Unauthorized("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' (or 'X-Api-Key').")

    def refusal(self, request: Request) -> Reply | None:
        """check() as the client port's head check: the 401 to answer, or None."""
        try:
            self.check(request)
        except Unauthorized as exc:
            return error_response(exc)
        return None
