"""The programs outside the venv that these tests drive: Debian's prometheus and promtool, and tmux.

Where one is missing a test skips saying which package brings it, except
under ROUTER_REQUIRE_OPERATOR_TOOLS=1 (as .ci/run sets, after installing
them), where a missing program fails the test instead of hiding it.
"""

from __future__ import annotations

import os
import shutil

import pytest

PACKAGES = {"prometheus": "prometheus", "promtool": "prometheus", "tmux": "tmux"}


def program(name: str) -> str:
    """The path of `name`; a skip (a failure under ROUTER_REQUIRE_OPERATOR_TOOLS=1) when it is not installed."""
    found = shutil.which(name)
    if found is not None:
        return found
    why = f"{name} is not installed (Debian's {PACKAGES[name]} package; .ci/run installs it)"
    if os.environ.get("ROUTER_REQUIRE_OPERATOR_TOOLS") == "1":
        pytest.fail(f"ROUTER_REQUIRE_OPERATOR_TOOLS=1 but {why}")
    pytest.skip(why)
