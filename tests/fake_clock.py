"""Left only for tests/http/client, which imports it: tests/support/clock.py now. Delete once that moves."""

from __future__ import annotations

from tests.support.clock import FakeClock, FakeTimer

__all__ = ["FakeClock", "FakeTimer"]
