"""`router fake` as a user runs it: it says where it listens, refuses a port in use, and stops on Ctrl-C.

Real processes on loopback. Each is stopped by the test whatever happens
(killed if a signal did not stop it), and SIGINT must stop it even when it
was started ignoring SIGINT, as a background job of a non-interactive shell
is: a fake must not depend on the disposition it inherits.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson
import pytest

FAKE = [sys.executable, "-m", "router", "fake"]


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def running(*args: str, ignoring_sigint: bool = False) -> Iterator[subprocess.Popen[str]]:
    """`router fake ARGS`, stopped at the end: SIGINT, then SIGKILL if it did not stop."""
    process = subprocess.Popen(
        [*FAKE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint if ignoring_sigint else None,  # noqa: PLW1509 (a signal disposition, nothing else)
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def ready_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, process.stderr.read() if process.stderr is not None else "no output"
    return line.rstrip("\n")


@contextlib.contextmanager
def port_group() -> Iterator[int]:
    """A port of the test's own for fakes told it: a socket in their SO_REUSEPORT group, never listening
    (it takes no connections), held while the block runs, so that no other test's listener takes the port."""
    with socket.socket() as group:
        group.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        group.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        group.bind(("127.0.0.1", 0))
        yield group.getsockname()[1]


def models_at(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
        return [m["id"] for m in orjson.loads(resp.read())["data"]]


def test_it_prints_its_address_and_models_once_it_listens_and_serves_them() -> None:
    with running("--port", "0", "--model", "a", "--model", "b") as fake:
        line = ready_line(fake)
        match = re.fullmatch(r"fake replica of a, b at (http://127\.0\.0\.1:\d+)", line)
        assert match is not None, line
        assert models_at(match.group(1)) == ["a", "b"]


def test_sigint_stops_it_though_it_was_started_ignoring_sigint() -> None:
    with running("--port", "0", ignoring_sigint=True) as fake:
        ready_line(fake)
        fake.send_signal(signal.SIGINT)
        assert fake.wait(10) == 0


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_it_while_streams_keep_its_loop_in_callbacks(stop: signal.Signals) -> None:
    # A Python signal handler runs inside whatever callback the loop is in; one that raised
    # SystemExit there was logged as a transport's fatal error and the fake ran on (seen once
    # in a full run, not reproduced at will): the signal is the loop's now, and streams read
    # as fast as they come keep the loop busy when it lands.
    with running("--port", "0", "--tokens", "100000", "--token-delay", "0") as fake:
        url = re.findall(r"http://\S+", ready_line(fake))[0]
        body = orjson.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        streams = []
        for _ in range(4):
            client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body
            )
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            streams.append(client)
        # Read as fast as they come, so that the fake's loop is always in a callback.
        readers = [threading.Thread(target=drain, args=(client,), daemon=True) for client in streams]
        for reader in readers:
            reader.start()
        try:
            fake.send_signal(stop)
            assert fake.wait(10) == 0
        finally:
            for client in streams:
                client.close()
            for reader in readers:
                reader.join(10)


def drain(client: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while client.recv(65536):
            pass


def test_a_port_in_use_is_refused_in_one_line_unless_asked_to_share_it() -> None:
    # A port given (SO_REUSEPORT is set on a given port only, for a second fake to share), held by the test.
    with port_group() as port, running("--port", str(port), "--model", "first") as first:
        assert ready_line(first) == f"fake replica of first at http://127.0.0.1:{port}"
        refused = subprocess.run([*FAKE, "--port", str(port)], capture_output=True, text=True, timeout=30, check=False)
        assert refused.returncode == 2
        assert refused.stderr.splitlines() == [
            f"router fake: cannot listen on 127.0.0.1:{port}: Address already in use "
            "(--share-port to share it with what listens there)"
        ]
        with running("--port", str(port), "--model", "second", "--share-port") as second:
            assert ready_line(second) == f"fake replica of second at http://127.0.0.1:{port}"
            # Both answer on the port now: the kernel spreads new connections over them.
            seen: set[str] = set()
            deadline = time.monotonic() + 10
            while len(seen) < 2:
                assert time.monotonic() < deadline, seen
                seen.update(models_at(f"http://127.0.0.1:{port}"))
            assert seen == {"first", "second"}


def test_a_port_held_by_something_that_does_not_share_is_refused_even_when_asked_to_share() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*FAKE, "--port", str(port), "--share-port"], capture_output=True, text=True, timeout=30, check=False
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"router fake: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_several_processes_say_where_they_listen_once() -> None:
    # --processes refuses port 0 (each process would take a port of its own).
    with port_group() as port, running("--port", str(port), "--processes", "2") as fake:
        assert ready_line(fake) == f"fake replica of fake-model at http://127.0.0.1:{port} in 2 processes"
        assert models_at(f"http://127.0.0.1:{port}") == ["fake-model"]
        fake.send_signal(signal.SIGINT)
        assert fake.wait(10) == 0
        assert fake.stdout is not None and fake.stdout.read() == ""


def test_enable_sleep_mode_serves_the_sleep_api_and_answers_503_asleep() -> None:
    with running("--port", "0", "--enable-sleep-mode", "--wake-seconds", "0.05") as fake:
        url = ready_line(fake).rsplit(" ", 1)[1]
        urllib.request.urlopen(urllib.request.Request(url + "/sleep?level=1", method="POST"), timeout=5).close()
        with urllib.request.urlopen(url + "/is_sleeping", timeout=5) as resp:
            assert orjson.loads(resp.read()) == {"is_sleeping": True}
        chat = urllib.request.Request(url + "/v1/chat/completions", data=b'{"model": "fake-model"}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(chat, timeout=5).close()
        assert refused.value.code == 503
        assert b"sleeping" in refused.value.read()
        urllib.request.urlopen(urllib.request.Request(url + "/wake_up", method="POST"), timeout=5).close()
        with urllib.request.urlopen(url + "/is_sleeping", timeout=5) as resp:
            assert orjson.loads(resp.read()) == {"is_sleeping": False}


def test_sleep_flags_are_checked() -> None:
    done = subprocess.run(
        [*FAKE, "--port", "0", "--wake-seconds", "-1"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2
    assert "--sleep-seconds and --wake-seconds must be >= 0" in done.stderr
    done = subprocess.run([*FAKE, "--asleep-answer", "nap"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "invalid choice: 'nap'" in done.stderr
