"""A soak: mixed load for a long while, and proof that nothing grows or leaks.

    .venv/bin/python bench/soak.py [--minutes 30] [--sample-every 60] [--short] [--json FILE]

A router (`router serve`, its own process) in front of five fake replicas in
this process, under load from clients that behave and clients that do not:

- model `m`: two replicas, one that closes idle keep-alive connections after
  1 s (before the router's own 2 s, so the keep-alive race happens) and one
  with no idle timeout of its own (only the router's sweep closes those);
- model `flaky`: two replicas killed in turn (every connection reset, the
  port refusing) and restarted a few seconds later;
- model `cold`: one replica killed for a while, again and again; the model
  holds requests (`cold_start_seconds`), so they wait for it to come back;
- clients: short chats, streams, embeddings, streams the client leaves after
  a few chunks, requests for the cold and the flaky model, each with its own
  `X-Request-Id`;
- hostile clients on the side, from the hostile-client tests' repertoire: a
  slow head, a body that stops, a pipelined burst, garbage, a smuggling
  attempt, a client that leaves mid-body, model names of a megabyte.

Every `--sample-every` seconds it samples the router process: RSS, open file
descriptors, upstream connections per replica (its sockets, from /proc),
requests in flight (admin API) and the size of the /metrics text. At the
end, with the load stopped, it waits out the upstream keep-alive and samples
once more.

It checks, and exits 1 naming each check that failed:
- every request is accounted for: the client saw an answer (complete, an
  OpenAI-shaped error, or a stream that ended broken), or left on purpose;
  none unanswered, none hung;
- no request reached a replica twice (the replicas record every
  X-Request-Id they receive), and every complete answer came from one;
- after warm-up, RSS, file descriptors and the metrics text stay flat, and
  upstream connections stay below the clients' concurrency;
- once idle: every upstream connection closed after the keep-alive, nothing
  in flight, file descriptors back to the start's;
- every hostile client got the answer the hostile-client tests expect.

`--short` (2 minutes, a sample every 10 s, tighter bounds) is what CI runs
(tests/test_soak.py); the long run's figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import free_port, serve  # noqa: E402
from router.tools.fake import Behaviour, FakeReplica  # noqa: E402

KEEPALIVE = 2.0  # the router's upstream_keepalive_seconds
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
CONCURRENCY = 16
REQUEST_TIMEOUT = 60.0


@dataclass
class Bounds:
    """How flat is flat: growth allowed after warm-up, per measure."""

    rss_mb: float
    # Growth of the median number of open files, from the first third after warm-up to the last.
    # Open files follow the requests in flight, which a loaded machine lets
    # pile up; a leak shows for sure once idle, where the bound is 4.
    fds: int
    metrics_fraction: float


LONG = Bounds(rss_mb=10.0, fds=CONCURRENCY, metrics_fraction=0.10)
SHORT = Bounds(rss_mb=6.0, fds=CONCURRENCY, metrics_fraction=0.05)
# Open files at any sample: the clients' and the hostile clients' connections
# (a hostile round starts every 0.1-0.5 s and may wait up to 9 s), one
# upstream connection per request in flight, and the idle pools.
MOST_FILES = 4 * CONCURRENCY + 32


@dataclass
class Replica:
    id: str
    model: str
    keepalive: float
    # Seconds between streamed tokens: long enough on the flaky replicas that a kill cuts streams.
    token_delay: float = 0.004
    fake: FakeReplica = field(init=False)
    # Told its port: it comes back where the router knows it after each kill.
    port: int = field(default_factory=free_port)
    down: bool = False

    def __post_init__(self) -> None:
        self.fake = self._new()

    def _new(self) -> FakeReplica:
        return FakeReplica(
            models=(self.model,),
            name=self.id,
            keepalive_timeout=self.keepalive,
            behaviour=Behaviour(tokens=24, token_delay=self.token_delay),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.fake.start("127.0.0.1", self.port)
        self.down = False

    async def kill(self) -> None:
        self.down = True
        await self.fake.kill()

    async def restart(self) -> None:
        # A new process of the engine: nothing of the old one's state.
        received = self.fake
        self.fake = self._new()
        self.fake.seen = received.seen
        await self.start()


@dataclass
class Ledger:
    """What the clients saw, per request id, and what the replicas received."""

    outcomes: dict[str, str] = field(default_factory=dict)
    received: collections.Counter[str] = field(default_factory=collections.Counter)
    hostile: collections.Counter[str] = field(default_factory=collections.Counter)
    hostile_failures: list[str] = field(default_factory=list)

    def count(self) -> collections.Counter[str]:
        return collections.Counter(self.outcomes.values())


# Clients that behave -------------------------------------------------------------------


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


async def one_request(session: aiohttp.ClientSession, base: str, rng: random.Random, ledger: Ledger) -> None:
    kind = rng.choices(["short", "stream", "leave", "embed", "cold", "flaky"], weights=[40, 25, 8, 7, 10, 10], k=1)[0]
    rid = str(uuid.uuid4())
    path = "/v1/chat/completions"
    body: dict[str, Any] = {**CHAT, "model": "m"}
    if kind in {"stream", "leave"}:
        body["stream"] = True
    elif kind == "embed":
        path, body = "/v1/embeddings", {"model": "m", "input": "soak"}
    elif kind == "cold":
        body["model"] = "cold"
    elif kind == "flaky":
        body.update(model="flaky", stream=rng.random() < 0.5)
    ledger.outcomes[rid] = "sent"
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT):
            async with session.post(base + path, data=orjson.dumps(body), headers={"X-Request-Id": rid}) as resp:
                if resp.status >= 400:
                    error = await resp.json(content_type=None)
                    ok = isinstance(error, dict) and isinstance(error.get("error"), dict)
                    ledger.outcomes[rid] = f"error_{resp.status}" if ok else "malformed_error"
                    return
                if kind == "leave":
                    await resp.content.readany()
                    ledger.outcomes[rid] = "left"
                    return  # leaving the block closes the connection mid-stream
                try:
                    data = await resp.read()
                except aiohttp.ClientPayloadError:
                    ledger.outcomes[rid] = "broken"
                    return
                if body.get("stream"):
                    done = data.endswith(b"data: [DONE]\n\n")
                    ledger.outcomes[rid] = "ok" if done else "broken"
                else:
                    ledger.outcomes[rid] = "ok" if orjson.loads(data).get("object") else "malformed"
    except TimeoutError:
        ledger.outcomes[rid] = "hung"
    except (aiohttp.ClientError, ConnectionError) as exc:
        ledger.outcomes[rid] = f"unanswered: {type(exc).__name__}"


async def client_loop(base: str, seed: int, stop: asyncio.Event, ledger: Ledger) -> None:
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=1, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        while not stop.is_set():
            await one_request(session, base, rng, ledger)
            await asyncio.sleep(rng.uniform(0, 0.02))


# Clients that do not ---------------------------------------------------------------------


async def _exchange(address: tuple[str, int], data: bytes, *, then_wait: float = 5.0) -> bytes:
    """Send `data`, read until the router closes (or `then_wait` passes); what came back."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(then_wait):
            while chunk := await reader.read(65536):
                out += chunk
        return out
    except TimeoutError:
        return out + b"<still open>"
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _post(body: bytes, extra: bytes = b"", close: bool = True) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        + connection
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def hostile_round(address: tuple[str, int], rng: random.Random, ledger: Ledger) -> None:
    kind = rng.choice(["slow_head", "stopped_body", "pipelined", "garbage", "smuggle", "left_mid_body", "huge_name"])
    ledger.hostile[kind] += 1
    good = orjson.dumps({**CHAT, "model": "m"})
    expected: object
    if kind == "slow_head":
        answer = await _exchange(
            address, b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n", then_wait=3 * HEADER_TIMEOUT
        )
        # Closed by the header deadline (with a 408 or without a word), never held open.
        ok, expected = not answer.endswith(b"<still open>"), "closed within the header timeout"
    elif kind == "stopped_body":
        head = _post(b"x" * 100)[:-90]
        answer = await _exchange(address, head, then_wait=3 * BODY_TIMEOUT)
        ok, expected = _status(answer) == 408, 408
    elif kind == "pipelined":
        burst = b"".join(_post(good, close=False) for _ in range(9)) + _post(good)
        answer = await _exchange(address, burst, then_wait=30)
        ok, expected = answer.count(b"HTTP/1.1 200 OK") == 10, "10 answers of 200"
    elif kind == "garbage":
        answer = await _exchange(address, b"\x16\x03\x01 not http at all\r\n\r\n")
        ok, expected = _status(answer) == 400, 400
    elif kind == "smuggle":
        data = _post(good, extra=b"Transfer-Encoding: chunked\r\n")
        answer = await _exchange(address, data)
        ok, expected = _status(answer) == 400, 400
    elif kind == "left_mid_body":
        answer = await _exchange(address, _post(good)[:-10], then_wait=0.2)
        ok, expected = answer in (b"", b"<still open>"), "nothing (the client left)"
    else:
        name = "soak-" + "n" * (1 << 20) + str(rng.random())
        answer = await _exchange(address, _post(orjson.dumps({**CHAT, "model": name})))
        ok, expected = _status(answer) == 404 and len(answer) < 4096, "a short 404"
    if not ok:
        ledger.hostile_failures.append(f"{kind}: expected {expected}, got {answer[:120]!r}")


async def hostile_loop(address: tuple[str, int], stop: asyncio.Event, ledger: Ledger) -> None:
    rng = random.Random(7)
    running: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        task = asyncio.create_task(hostile_round(address, rng, ledger))
        running.add(task)
        task.add_done_callback(running.discard)
        await asyncio.sleep(rng.uniform(0.1, 0.5))
    await asyncio.gather(*running)


# Failures of replicas ---------------------------------------------------------------------


async def chaos(replicas: dict[str, Replica], stop: asyncio.Event, period: float) -> None:
    """Kill and restart: the flaky pair in turn, the cold one for longer."""
    flaky = [replicas["flaky-0"], replicas["flaky-1"]]
    cold = replicas["cold-0"]
    turn = 0
    while not stop.is_set():
        victim = flaky[turn % 2]
        await victim.kill()
        if turn % 2 == 0:
            await cold.kill()
        await _sleep_unless(stop, period * 0.2)
        await victim.restart()
        if cold.down and (turn % 2 == 0):
            await _sleep_unless(stop, period * 0.2)
            await cold.restart()
        turn += 1
        await _sleep_unless(stop, period * 0.6)
    for replica in replicas.values():
        if replica.down:
            await replica.restart()


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


# Samples of the router process --------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def socket_inodes(pid: int) -> tuple[int, set[int]]:
    count, inodes = 0, set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        count += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return count, inodes


def upstream_connections(pid: int, ports: dict[int, str]) -> dict[str, int]:
    """The router's established TCP connections to each replica's port."""
    _, inodes = socket_inodes(pid)
    out = dict.fromkeys(ports.values(), 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            state = parts[3]
            if int(parts[9]) in inodes and remote_port in ports and state == "01":  # ESTABLISHED
                out[ports[remote_port]] += 1
    return out


async def sample(pid: int, admin: str, ports: dict[int, str], started: float, ledger: Ledger) -> dict[str, Any]:
    fds, _ = socket_inodes(pid)
    async with aiohttp.ClientSession() as session:
        async with session.get(admin + "/metrics") as resp:
            metrics = await resp.read()
        async with session.get(admin + "/api/v1/replicas") as resp:
            replicas = await resp.json()
    return {
        "at_seconds": round(time.monotonic() - started, 1),
        "rss_mb": round(rss_mb(pid), 1),
        "fds": fds,
        "upstream": upstream_connections(pid, ports),
        "in_flight": sum(r["in_flight"] for r in replicas),
        "metrics_bytes": len(metrics),
        "requests": len(ledger.outcomes),
    }


def _request_id(headers: dict[str, str]) -> str:
    return next((value for name, value in headers.items() if name.lower() == "x-request-id"), "")


def collect_received(replicas: dict[str, Replica], ledger: Ledger) -> None:
    """Move what the replicas recorded into the ledger: ids only, so that a long soak holds no bodies."""
    for replica in replicas.values():
        seen, replica.fake.seen[:] = list(replica.fake.seen), []
        ledger.received.update(_request_id(s.headers) for s in seen)
    ledger.received.pop("", None)


async def sampler(
    pid: int,
    admin: str,
    replicas: dict[str, Replica],
    every: float,
    stop: asyncio.Event,
    ledger: Ledger,
    out: list[dict[str, Any]],
) -> None:
    started = time.monotonic()
    ports = {r.port: r.id for r in replicas.values()}
    while not stop.is_set():
        await _sleep_unless(stop, every)
        collect_received(replicas, ledger)
        if not stop.is_set():
            out.append(await sample(pid, admin, ports, started, ledger))
            print(json.dumps(out[-1]), flush=True)


# Verdicts --------------------------------------------------------------------------------


def verdicts(
    ledger: Ledger, samples: list[dict[str, Any]], idle: dict[str, Any], start_fds: int, bounds: Bounds
) -> list[str]:
    failed: list[str] = []
    counts = ledger.count()
    unanswered = {k: n for k, n in counts.items() if k.startswith("unanswered") or k in ("hung", "sent", "malformed")}
    unanswered.update({k: n for k, n in counts.items() if k == "malformed_error"})
    if unanswered:
        failed.append(f"requests not accounted for: {unanswered}")
    twice = {rid: n for rid, n in ledger.received.items() if n > 1}
    if twice:
        failed.append(f"{len(twice)} requests reached a replica more than once, e.g. {next(iter(twice))}")
    complete = [rid for rid, outcome in ledger.outcomes.items() if outcome == "ok"]
    missing = [rid for rid in complete if ledger.received[rid] != 1]
    if missing:
        failed.append(f"{len(missing)} complete answers that no replica recorded, e.g. {missing[0]}")
    warm = samples[max(1, len(samples) // 4) :]
    if len(warm) >= 2:
        third = max(1, len(warm) // 3)
        early = statistics.median(s["rss_mb"] for s in warm[:third])
        late = statistics.median(s["rss_mb"] for s in warm[-third:])
        if late - early > bounds.rss_mb:
            failed.append(f"RSS grew {late - early:.1f} MB after warm-up (bound {bounds.rss_mb} MB)")
        most_files = max(s["fds"] for s in warm)
        if most_files > start_fds + MOST_FILES:
            failed.append(f"open files reached {most_files} (start {start_fds}, bound +{MOST_FILES})")
        early_files = statistics.median(s["fds"] for s in warm[:third])
        late_files = statistics.median(s["fds"] for s in warm[-third:])
        if late_files - early_files > bounds.fds:
            failed.append(f"open files grew from a median of {early_files} to {late_files} after warm-up")
        first, last = warm[0]["metrics_bytes"], max(s["metrics_bytes"] for s in warm)
        if last > first * (1 + bounds.metrics_fraction):
            failed.append(f"/metrics grew from {first} to {last} bytes after warm-up")
        most = max(n for s in warm for n in s["upstream"].values())
        if most > 2 * CONCURRENCY:
            failed.append(f"{most} upstream connections to one replica (clients: {CONCURRENCY})")
    left_open = {name: n for name, n in idle["upstream"].items() if n}
    if left_open:
        failed.append(f"upstream connections still open {idle['after_idle_seconds']} s after the load: {left_open}")
    if idle["in_flight"]:
        failed.append(f"{idle['in_flight']} requests still in flight after the load")
    if idle["fds"] > start_fds + 4:
        failed.append(f"open files {idle['fds']} once idle (start {start_fds})")
    if ledger.hostile_failures:
        failed.append(
            f"{len(ledger.hostile_failures)} hostile clients got another answer: {ledger.hostile_failures[:3]}"
        )
    return failed


def report(
    args: argparse.Namespace, ledger: Ledger, samples: list[dict[str, Any]], idle: dict[str, Any], failed: list[str]
) -> str:
    counts = ledger.count()
    lines = [
        f"soak: {args.minutes:g} min, {len(ledger.outcomes)} requests, {sum(ledger.hostile.values())} hostile clients",
        "",
        "| min | RSS MB | open files | upstream connections (m-idle1s, m-noidle, flaky-0, flaky-1, cold-0) "
        "| in flight | /metrics bytes | requests |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in [*samples, idle]:
        up = ", ".join(str(n) for n in s["upstream"].values())
        at = s.get("at_seconds", 0) / 60
        lines.append(
            f"| {at:.1f} | {s['rss_mb']} | {s['fds']} | {up} | {s['in_flight']} "
            f"| {s['metrics_bytes']} | {s['requests']} |"
        )
    lines += [
        "",
        "outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())),
        "hostile: " + ", ".join(f"{k} {n}" for k, n in sorted(ledger.hostile.items())),
        f"received twice by a replica: {sum(1 for n in ledger.received.values() if n > 1)}",
        "",
        "verdict: " + ("every check passed" if not failed else "FAILED:\n- " + "\n- ".join(failed)),
    ]
    return "\n".join(lines)


async def soak(args: argparse.Namespace) -> int:
    bounds = SHORT if args.short else LONG
    replicas = {
        r.id: r
        for r in (
            Replica("m-idle1s", "m", 1.0),
            Replica("m-noidle", "m", 24 * 3600.0),
            Replica("flaky-0", "flaky", 24 * 3600.0, token_delay=0.02),
            Replica("flaky-1", "flaky", 5.0, token_delay=0.02),
            Replica("cold-0", "cold", 24 * 3600.0),
        )
    }
    for replica in replicas.values():
        await replica.start()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "router.toml"
        log = Path(tmp) / "router.log"
        lines = [
            'listen = "127.0.0.1:0"',
            'admin_listen = "127.0.0.1:0"',
            "tick_seconds = 1",
            f"upstream_keepalive_seconds = {KEEPALIVE}",
            f"header_timeout_seconds = {HEADER_TIMEOUT}",
            f"body_timeout_seconds = {BODY_TIMEOUT}",
            "write_stall_timeout_seconds = 10",
            "connect_timeout_seconds = 2",
            "ejection_failures = 3",
            "ejection_base_seconds = 1",
            "ejection_max_seconds = 4",
        ]
        for r in replicas.values():
            lines += ["[[replicas]]", f'id = "{r.id}"', f'model = "{r.model}"', f'url = "{r.url}"']
        lines += ['[models."cold"]', "cold_start_seconds = 40"]
        config.write_text("\n".join(lines) + "\n")
        # On port 0: the ports are what it says once it listens; the rest of what it says goes to `log`.
        process, base, admin_url = serve(config, "--log-level", "error", log=log)
        client = int(base.rsplit(":", 1)[1])
        try:
            start_fds, _ = socket_inodes(process.pid)
            ports = {r.port: r.id for r in replicas.values()}
            ledger = Ledger()
            samples: list[dict[str, Any]] = []
            stop = asyncio.Event()
            period = 20.0 if args.short else 45.0
            tasks = [asyncio.create_task(client_loop(base, seed, stop, ledger)) for seed in range(CONCURRENCY)]
            tasks.append(asyncio.create_task(hostile_loop(("127.0.0.1", client), stop, ledger)))
            tasks.append(asyncio.create_task(chaos(replicas, stop, period)))
            tasks.append(
                asyncio.create_task(sampler(process.pid, admin_url, replicas, args.sample_every, stop, ledger, samples))
            )
            await asyncio.sleep(args.minutes * 60)
            stop.set()
            await asyncio.gather(*tasks)
            # Idle: every kept-alive upstream connection must close after the keep-alive.
            after = 3 * KEEPALIVE + 1
            await asyncio.sleep(after)
            idle = await sample(process.pid, admin_url, ports, time.monotonic(), ledger)
            idle["after_idle_seconds"] = after
            idle["at_seconds"] = args.minutes * 60 + after
            collect_received(replicas, ledger)
            failed = verdicts(ledger, samples, idle, start_fds, bounds)
            text = report(args, ledger, samples, idle, failed)
            print(text)
            if args.json:
                Path(args.json).write_text(
                    json.dumps(
                        {
                            "minutes": args.minutes,
                            "samples": samples,
                            "idle": idle,
                            "outcomes": ledger.count(),
                            "hostile": ledger.hostile,
                            "failed": failed,
                        },
                        indent=2,
                    )
                )
            if process.poll() is not None:
                print(f"the router exited with status {process.returncode}")
                return 1
            return 1 if failed else 0
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            said = log.read_text(errors="replace") if log.exists() else ""
            # What it said besides where it listens.
            err = "".join(line for line in said.splitlines(keepends=True) if "router listening on" not in line)
            if err:
                sys.stderr.write(err[-4000:])
            for replica in replicas.values():
                await replica.fake.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument(
        "--short", action="store_true", help="CI's version: 2 minutes, samples every 10 s, tighter bounds"
    )
    parser.add_argument("--json", help="also write the samples and verdicts here")
    args = parser.parse_args()
    if args.short:
        args.minutes, args.sample_every = min(args.minutes, 2.0), 10.0
    import uvloop

    return uvloop.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
