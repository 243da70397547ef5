"""The sleep tier, measured: the first request after idleness, the held requests' added latency, and a soak.

    .venv/bin/python bench/sleep.py [--scale 20] [--rounds 5] [--burst 20] [--soak-seconds 20] [--json]

The engine times are vLLM's published figures (blog.vllm.ai, "Zero-Reload
Model Switching with vLLM Sleep Mode", 2025-10-26: a level-1 wake in 0.1 to
6 s depending on the model and GPU, a reload 30 to 100+ s, "18-200x faster"),
taken at a mid point, a 2.6 s wake and a 52 s cold start, and run `--scale`
times faster so that the bench takes a minute.

1. First request after idleness, through `router serve`: (a) its one replica
   asleep (a fake with vLLM's sleep API, woken by the router: wake call, then
   /is_sleeping); (b) scaled to zero (no replica; the request held with
   `cold_start_seconds`; the replica starts after the cold start and is
   pushed). Reported: the client's latency of that first request.
2. Held requests' added latency over the wake: `--burst` requests held while
   the replica sleeps, `--rounds` times; each request's answer time minus the
   later of its arrival and the end of the engine's wake. Target: p99 < 100 ms.
3. A soak (`--soak-seconds`): two routers in front of two sleepable replicas,
   clients streaming through both, and a control loop that puts a replica to
   sleep across both routers (the two-phase fence of `router ctl sleep`)
   every second or so, the requests waking it again. Checked: no sleep call
   ever reaches an engine with a request in flight, and every request is
   answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import serve  # noqa: E402
from router.tools.fake import Behaviour, FakeReplica, SleepMode  # noqa: E402

WAKE_SECONDS = 2.6
COLD_START_SECONDS = 52.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def start_router(tmp: Path, name: str, replicas: list[dict[str, str]], extra: str = "") -> tuple[Any, str, str]:
    config = tmp / f"{name}.toml"
    lines = ['listen = "127.0.0.1:0"', 'admin_listen = "127.0.0.1:0"', "tick_seconds = 0.2", extra]
    for r in replicas:
        lines += ["[[replicas]]", *(f'{k} = "{v}"' for k, v in r.items())]
    config.write_text("\n".join(lines) + "\n")
    return await asyncio.to_thread(serve, config)


async def state(session: aiohttp.ClientSession, admin: str, rid: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{admin}/api/v1/replicas/{rid}/state", json=body) as resp:
        answer: dict[str, Any] = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{admin}: {body} -> {resp.status} {answer}")
        return answer


async def chat(session: aiohttp.ClientSession, client: str, *, stream: bool = False) -> int:
    async with session.post(f"{client}/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
        await resp.read()
        return resp.status


async def first_request(tmp: Path, scale: float) -> dict[str, float]:
    wake, cold = WAKE_SECONDS / scale, COLD_START_SECONDS / scale
    fake = FakeReplica(models=("m",), record=False, sleep=SleepMode(wake_seconds=wake))
    await fake.start()
    asleep = await start_router(tmp, "asleep", [{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}])
    zero = await start_router(tmp, "zero", [], '[models."m"]\ncold_start_seconds = 600')
    figures = {}
    try:
        async with aiohttp.ClientSession() as session:
            await state(session, asleep[2], "r0", {"state": "asleep"})
            began = time.perf_counter()
            assert await chat(session, asleep[1]) == 200
            figures["sleeping_replica_s"] = time.perf_counter() - began

            async def cold_start() -> None:
                await asyncio.sleep(cold)
                late = FakeReplica(models=("m",), record=False)
                await late.start()
                cold_fakes.append(late)
                async with session.put(
                    f"{zero[2]}/api/v1/endpoints", json={"replicas": [{"id": "z0", "model": "m", "url": late.url}]}
                ) as resp:
                    assert resp.status == 200

            cold_fakes: list[FakeReplica] = []
            began = time.perf_counter()
            starting = asyncio.ensure_future(cold_start())
            assert await chat(session, zero[1]) == 200
            figures["scaled_to_zero_s"] = time.perf_counter() - began
            await starting
            for late in cold_fakes:
                await late.stop()
    finally:
        for process in (asleep[0], zero[0]):
            process.kill()
            process.wait()
        await fake.stop()
    figures["wake_s"], figures["cold_start_s"] = wake, cold
    return figures


async def held_latency(tmp: Path, scale: float, rounds: int, burst: int) -> dict[str, float]:
    sleep = SleepMode(wake_seconds=WAKE_SECONDS / scale)
    fake = FakeReplica(models=("m",), record=False, behaviour=Behaviour(tokens=2), sleep=sleep)
    await fake.start()
    process, client, admin = await start_router(
        tmp, "held", [{"id": "r0", "model": "m", "url": fake.url, "engine": "vllm"}], '[models."m"]\nmax_held = 1000'
    )
    added: list[float] = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(rounds):
                await state(session, admin, "r0", {"state": "asleep"})

                async def one() -> tuple[float, float, int]:
                    arrived = time.monotonic()
                    status = await chat(session, client)
                    return arrived, time.monotonic(), status

                tasks = []
                for _ in range(burst):
                    tasks.append(asyncio.ensure_future(one()))
                    # Spread over the first half of the wake: some before it starts, most while it runs.
                    await asyncio.sleep(sleep.wake_seconds / (2 * burst))
                results = await asyncio.gather(*tasks)
                woke = sleep.woke_at[-1]
                for arrived, answered, status in results:
                    assert status == 200, status
                    added.append(answered - max(arrived, woke))
    finally:
        process.kill()
        process.wait()
        await fake.stop()
    added.sort()
    return {
        "samples": len(added),
        "p50_ms": 1000 * statistics.median(added),
        "p99_ms": 1000 * added[min(len(added) - 1, int(0.99 * len(added)))],
        "max_ms": 1000 * added[-1],
    }


async def soak(tmp: Path, seconds: float) -> dict[str, Any]:
    fakes = [
        FakeReplica(
            models=("m",),
            record=False,
            behaviour=Behaviour(tokens=8, token_delay=0.01),
            sleep=SleepMode(sleep_seconds=0.02, wake_seconds=0.05),
        )
        for _ in range(2)
    ]
    for fake in fakes:
        await fake.start()
    replicas = [{"id": f"r{i}", "model": "m", "url": f.url, "engine": "vllm"} for i, f in enumerate(fakes)]
    routers = [await start_router(tmp, f"soak-{n}", replicas, "wake_timeout_seconds = 5") for n in "ab"]
    answered: dict[int, int] = {}
    sleeps = failed_sleeps = 0
    stop = time.monotonic() + seconds
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(index: int) -> None:
                url = routers[index % 2][1]
                while time.monotonic() < stop:
                    status = await chat(session, url, stream=True)
                    answered[status] = answered.get(status, 0) + 1
                    await asyncio.sleep(random.uniform(0, 0.05))

            async def controller() -> None:
                nonlocal sleeps, failed_sleeps
                rng = random.Random(1)
                while time.monotonic() < stop:
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    rid = f"r{rng.randrange(2)}"
                    try:
                        # router ctl sleep's two phases: every router fences, then one calls the engine.
                        for _, _, admin in routers:
                            await state(session, admin, rid, {"state": "draining"})
                        for _, _, admin in routers:
                            while True:
                                async with session.get(f"{admin}/api/v1/replicas") as resp:
                                    row = next(r for r in await resp.json() if r["id"] == rid)
                                if row["state"] == "drained":
                                    break
                                await asyncio.sleep(0.01)
                        await state(session, routers[0][2], rid, {"state": "asleep", "wait_seconds": 0})
                        for _, _, admin in routers[1:]:
                            await state(session, admin, rid, {"state": "asleep", "call_engine": False})
                        sleeps += 1
                    except RuntimeError:
                        failed_sleeps += 1
                        for _, _, admin in routers:
                            await state(session, admin, rid, {"state": "ready"})

            await asyncio.gather(controller(), *(client(i) for i in range(6)))
    finally:
        for process, _, _ in routers:
            process.kill()
            process.wait()
        for fake in fakes:
            await fake.stop()
    busy = [n for fake in fakes for n in (fake.sleep.busy_at_sleep if fake.sleep else [])]
    wakes = sum(1 for fake in fakes for c in (fake.sleep.calls if fake.sleep else []) if c.startswith("wake"))
    return {
        "seconds": seconds,
        "sleeps": sleeps,
        "failed_sleeps": failed_sleeps,
        "engine_sleep_calls": len(busy),
        "sleeps_with_a_request_in_flight": sum(1 for n in busy if n),
        "engine_wake_calls": wakes,
        "answers_by_status": {str(k): v for k, v in sorted(answered.items())},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        return {
            "first_request": await first_request(tmp, args.scale),
            "held_added_latency": await held_latency(tmp, args.scale, args.rounds, args.burst),
            "soak": await soak(tmp, args.soak_seconds),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=20.0, help="engine times this many times faster")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--soak-seconds", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    first, held, soaked = figures["first_request"], figures["held_added_latency"], figures["soak"]
    wake, cold = first["wake_s"], first["cold_start_s"]
    print(f"engine times 1/{args.scale:g} of vLLM's: wake {wake:.3f} s, cold start {cold:.3f} s")
    print(f"first request, replica asleep:   {first['sleeping_replica_s']:.3f} s")
    print(f"first request, scaled to zero:   {first['scaled_to_zero_s']:.3f} s")
    print(
        f"held requests' added latency over the wake ({held['samples']}): "
        f"p50 {held['p50_ms']:.1f} ms, p99 {held['p99_ms']:.1f} ms, max {held['max_ms']:.1f} ms (target p99 < 100 ms)"
    )
    print(
        f"soak {soaked['seconds']:g} s: {soaked['sleeps']} sleeps across both routers ({soaked['failed_sleeps']} "
        f"refused), {soaked['engine_wake_calls']} wakes, sleeps with a request in flight: "
        f"{soaked['sleeps_with_a_request_in_flight']}, answers {soaked['answers_by_status']}"
    )
    return 0 if soaked["sleeps_with_a_request_in_flight"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
