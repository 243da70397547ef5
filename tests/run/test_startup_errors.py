"""A mistake found at start is one line naming the file, the key and the problem, with exit status 2.

`router serve` as a real process, one router or `--workers 2`: an access log
that cannot be opened, an address something else listens on, a key that is
no setting but looks like one. Nothing is left behind: no traceback, no
second line, no workers' directory.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from router.core.config.settings import parse_config
from router.core.errors import ConfigError


def serve(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def addresses(tmp_path: Path, extra: str = "", listen: int | None = None, admin: int | None = None) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(f'listen = "127.0.0.1:{listen or 0}"\nadmin_listen = "127.0.0.1:{admin or 0}"\n{extra}')
    return path


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_an_access_log_that_cannot_be_opened_is_one_line_with_status_2(tmp_path: Path, workers: list[str]) -> None:
    config = addresses(tmp_path, 'access_log = "/proc/nope/access.log"\n')
    done = serve(config, *workers)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"router: {config}: access_log: cannot open '/proc/nope/access.log' for appending: No such file or directory"
    ]


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
@pytest.mark.parametrize("key", ["listen", "admin_listen"])
def test_an_address_in_use_is_named_in_one_line_with_status_2(tmp_path: Path, workers: list[str], key: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # Short: the workers' sockets go in it, and a Unix socket's path is at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="rt-") as runtime:
        try:
            config = addresses(tmp_path, **{"listen" if key == "listen" else "admin": port})
            done = serve(config, *workers, env={**os.environ, "TMPDIR": runtime})
        finally:
            taken.close()
        # The workers' directory went with them.
        assert os.listdir(runtime) == []
    assert done.returncode == 2
    # Found before a worker starts: nothing else is said.
    assert done.stderr.splitlines() == [
        f"router: {config}: {key}: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.parametrize(
    ("text", "key", "meant"),
    [
        ("tick_second = 1\n", "tick_second", "tick_seconds"),
        ("acess_log = '-'\n", "acess_log", "access_log"),
        ('[models."m"]\ncold_start_second = 30\n', 'models."m".cold_start_second', "cold_start_seconds"),
        (
            '[discovery.kubernetes]\nselectr = "a=b"\nport = 80\n',
            "discovery.kubernetes.selectr",
            "selector",
        ),
    ],
)
def test_an_unknown_key_that_looks_like_a_setting_says_which_one_it_means(text: str, key: str, meant: str) -> None:
    import tomllib

    with pytest.raises(ConfigError) as caught:
        parse_config(tomllib.loads(text), "router.toml", environ={})
    assert str(caught.value) == f"router.toml: {key}: unknown key (did you mean '{meant}'?)"


def test_an_unknown_key_like_no_setting_is_only_unknown() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"colour": "red"}, "router.toml", environ={})
    assert str(caught.value) == "router.toml: colour: unknown key"
