"""Left only for tests/http/client, which imports it: the helpers are in tests/support/. Delete once that moves.

tests/http/client is another change's to edit; once its imports name
tests/support/, this module goes.
"""

from __future__ import annotations

from tests.support.raw_server import HEAD, OK, RawServer, StartRaw, fixed
from tests.support.waiting import wait_for

__all__ = ["HEAD", "OK", "RawServer", "StartRaw", "fixed", "wait_for"]
