"""Where `router serve --workers` keeps its workers' sockets and state, and what it says when it cannot.

A container with a read-only root (`readOnlyRootFilesystem: true`) has no
writable /tmp unless one is mounted; under systemd, `RuntimeDirectory=`
gives the unit its own. Each test runs `router serve --workers 2` as a real
process with the environment under test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import LISTENING, held_port, said
from tests.support.waiting import polled

pytestmark = pytest.mark.slow


def write_config(path: Path, client: int = 0) -> None:
    path.write_text(
        f'listen = "127.0.0.1:{client}"\nadmin_listen = "127.0.0.1:0"\ntick_seconds = 0.2\nshutdown_delay_seconds = 0\n'
    )


def environment(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP", "RUNTIME_DIRECTORY")}
    return {**env, **changes}


def ready(admin: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(admin, timeout=1) as s:
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def run_until_ready(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    host, port = said(process, LISTENING).group(2).removeprefix("http://").rsplit(":", 1)
    admin = (host, int(port))
    # The supervisor's readiness is an HTTP answer, no event a test can await.
    if not polled(lambda: process.poll() is not None or ready(admin), timeout=30) or process.poll() is not None:
        process.kill()
        out, _ = process.communicate(timeout=10)
        pytest.fail(f"router serve --workers 2 did not become ready: {out.decode()}")
    return process


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a Unix socket's path must fit in 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("variable", ["RUNTIME_DIRECTORY", "TMPDIR"])
def test_the_workers_directory_is_made_where_systemd_or_tmpdir_says_and_removed_at_exit(
    tmp_path: Path, short_dir: Path, variable: str
) -> None:
    """systemd's $RUNTIME_DIRECTORY (RuntimeDirectory=), else $TMPDIR, holds the sockets; it is gone after SIGTERM."""
    config = tmp_path / "router.toml"
    write_config(config)
    argv = [sys.executable, "-m", "router", "serve", "--config", str(config), "--workers", "2"]
    process = run_until_ready(argv, environment(**{variable: str(short_dir)}))
    try:
        (made,) = short_dir.glob("router-workers-*")
        assert sorted(p.name for p in made.glob("*.sock")) == ["worker-0.sock", "worker-1.sock"]
        assert made.stat().st_mode & 0o777 == 0o700
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out.decode()
    assert list(short_dir.iterdir()) == []


def test_no_writable_runtime_directory_is_exit_2_in_one_line_before_anything_listens(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with held_port() as client:
        write_config(config, client.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-m", "router", "serve", "--config", str(config), "--workers", "2"],
            env=environment(RUNTIME_DIRECTORY=str(not_a_directory)),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("router: --workers needs a writable directory for its workers' sockets and state")
        assert str(not_a_directory) in line and "TMPDIR" in line
        # Nothing was left listening on the client port.
        client.listen()


def unshare() -> str:
    found = shutil.which("unshare")
    if found is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to make a mount namespace with a read-only /tmp")
    probe = subprocess.run([found, "--mount", "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is refused here: {probe.stderr.decode().strip()}")
    return found


def test_a_read_only_tmp_is_exit_2_naming_tmpdir_not_a_traceback_about_listening() -> None:
    """As in a container with `readOnlyRootFilesystem: true` and no /tmp volume: /tmp and /var/tmp read-only."""
    tool = unshare()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as where:
        config = Path(where) / "router.toml"
        write_config(config)
        # Read-only in place (a bind mount of each onto itself), not hidden: this
        # checkout, its venv included, may well live under /tmp.
        read_only = " && ".join(f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in ("/tmp", "/var/tmp"))
        script = (
            f"{read_only} && "
            # The working directory is tempfile's last resort: one nobody can write to.
            f'cd /proc && exec "$0" -m router serve --config {config} --workers 2'
        )
        done = subprocess.run(
            [tool, "--mount", "--propagation", "private", "sh", "-c", script, sys.executable],
            # Not measured by coverage (make test's subprocess patch): a checkout under
            # the read-only /tmp could not take its data file, and would say so.
            env=environment(COVERAGE_PROCESS_CONFIG=""),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert "none of $TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory is one" in line
    assert "mount one at /tmp" in line
