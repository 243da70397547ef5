"""Left only for tests/http/client, which imports it: it is tests/support/wire.py now. Delete once that moves."""

from __future__ import annotations

from tests.support.wire import ending_quietly

__all__ = ["ending_quietly"]
