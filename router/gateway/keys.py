"""The client keys (`api_keys`): checked from a request's head, consumed, never forwarded."""

from __future__ import annotations

import hmac

from router.core.errors import Unauthorized
from router.gateway.answers import error_response
from router.http.messages import Reply, Request


class ApiKeys:
    """The client keys: compared in constant time, consumed, never forwarded."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode() for key in keys)
        self.active = bool(self._keys)
        # The router consumes the client's key; the replicas never see it. Anthropic's
        # clients send theirs as X-Api-Key.
        self.drop = frozenset({b"authorization", b"x-api-key"}) if self._keys else frozenset()

    def check(self, request: Request) -> None:
        if not self._keys:
            return
        header = (request.header(b"authorization") or b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if not header and (api_key := request.header(b"x-api-key")):
            # The Anthropic SDK's own header (its auth_token is sent as Bearer).
            scheme, given = "bearer", api_key.decode("latin-1")
        if scheme.lower() == "bearer" and given:
            candidate = given.strip().encode("latin-1")
            # Compare with every key, in constant time, so timing tells nothing.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(candidate, key)
            if matched:
                return
        raise Unauthorized("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' (or 'X-Api-Key').")

    def refusal(self, request: Request) -> Reply | None:
        """check() as the client port's head check: the 401 to answer, or None."""
        try:
            self.check(request)
        except Unauthorized as exc:
            return error_response(exc)
        return None
