"""A wake receiver: starts a replica when the router holds a request for a cold model, and pushes it.

    .venv/bin/python deploy/scale-from-zero/wake_receiver.py --listen 127.0.0.1:9400 \
        --router-admin http://127.0.0.1:9090 \
        --model llama-3.1-8b='vllm serve meta-llama/Llama-3.1-8B-Instruct --port {port}'

Run it with the router's own Python (the clone's `.venv/bin/python`, or the
one of the venv the router was installed in): it needs aiohttp, which the
router brings and a system Python usually lacks.

The router (`wake_url = "http://127.0.0.1:9400/wake"`) POSTs
`{"router", "model", "held", "since"}` here when a request for a model is
held. This receiver starts the model's command on a free port (`{port}` in
it), and at once adds the new replica to the router's set with
`PUT /api/v1/endpoints`: the router keeps the request held, tries the replica
with a short backoff while the engine loads (it refuses connections or
answers 503), and serves the held requests the moment it answers. A model
already started is not started again; `--admin-token` (or
ROUTER_ADMIN_TOKEN) is sent on the push and required on the wake call.

Each engine runs in a process group of its own, so that a Ctrl-C meant for
the receiver does not reach it unasked, and so that stopping it stops all
of it (vLLM's workers are children of the command started). On SIGTERM
(systemd, Kubernetes) or SIGINT (Ctrl-C) the receiver stops what it started:
SIGTERM to each engine's group, SIGKILL to what is left of it after
`--stop-grace-seconds`, then it exits 0. An engine left running after its
receiver is gone would hold a GPU that nothing knows of.

It keeps what it started in memory only: an example of the loop, not a
control plane (on Kubernetes, `router scaler` and KEDA do this).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

try:
    import aiohttp
    from aiohttp import web
except ModuleNotFoundError as exc:
    # The one dependency, there wherever the router is installed: say where to run it from.
    sys.exit(
        f"wake_receiver.py needs aiohttp ({exc}). Run it with the router's Python, which has it: "
        f".venv/bin/python {sys.argv[0]} ... (the clone's venv, made by `make setup`), "
        "or the python of the venv the router was installed in."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver:
    def __init__(self, admin: str, token: str, commands: dict[str, str]) -> None:
        self.admin = admin.rstrip("/")
        self.token = token
        self.commands = commands
        # model -> (process, replica entry)
        self.started: dict[str, tuple[asyncio.subprocess.Process, dict[str, Any]]] = {}
        self.lock = asyncio.Lock()

    async def wake(self, request: web.Request) -> web.Response:
        if self.token:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").encode()
            if not hmac.compare_digest(given, self.token.encode()):
                return web.json_response({"error": "bad token"}, status=401)
        doc = await request.json()
        model = doc.get("model")
        if model not in self.commands:
            return web.json_response({"error": f"no command for model {model!r}"}, status=404)
        async with self.lock:
            running = self.started.get(model)
            if running is None or running[0].returncode is not None:
                await self.start(model)
        return web.json_response({"started": model, "held": doc.get("held")})

    async def start(self, model: str) -> None:
        port = free_port()
        argv = shlex.split(self.commands[model].format(port=port, model=model))
        # Its own process group (and session): signals for the receiver's
        # terminal do not reach it, and killpg reaches every process it forks.
        process = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
        entry = {"id": f"{model}-{port}", "model": model, "url": f"http://127.0.0.1:{port}"}
        self.started[model] = (process, entry)
        print(f"started {model} on port {port} (pid {process.pid}); pushing it", file=sys.stderr)
        await self.push()

    async def push(self) -> None:
        """The whole desired set: what the router serves now, plus what was started here."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(self.admin + "/api/v1/endpoints") as resp:
                current = (await resp.json())["replicas"]
            ours = {entry["id"]: entry for _, entry in self.started.values()}
            desired = [r for r in current if r["id"] not in ours] + list(ours.values())
            async with session.put(self.admin + "/api/v1/endpoints", json={"replicas": desired}) as resp:
                resp.raise_for_status()

    async def stop(self, grace: float) -> None:
        """SIGTERM to every engine's process group; SIGKILL to what is left of each after `grace` seconds."""
        processes = [process for process, _ in self.started.values()]
        for process in processes:
            signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in processes:
            # The group outlives its leader while any child of it runs.
            while process.returncode is None or group_alive(process.pid):
                if time.monotonic() >= deadline:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), 0.1)
            signal_group(process.pid, signal.SIGKILL)
            await process.wait()


def signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def group_alive(group: int) -> bool:
    """Whether any process of the group still runs.

    A child whose parent died is a zombie until whoever inherited it (PID 1,
    or this receiver when it is PID 1 in a container) reaps it, and signals
    still reach the group meanwhile: on Linux, /proc tells zombies apart.
    """
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # After the command's name in parentheses: state, ppid, process group, ...
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:9400")
    parser.add_argument("--router-admin", default="http://127.0.0.1:9090")
    parser.add_argument("--admin-token", default=os.environ.get("ROUTER_ADMIN_TOKEN", ""))
    parser.add_argument("--model", action="append", default=[], metavar="NAME=COMMAND", required=True)
    parser.add_argument(
        "--stop-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long the engines get to stop before SIGKILL",
    )
    args = parser.parse_args(argv)
    commands = dict(item.split("=", 1) for item in args.model)
    receiver = Receiver(args.router_admin, args.admin_token, commands)
    app = web.Application()
    app.router.add_post("/wake", receiver.wake)
    runner = web.AppRunner(app)
    await runner.setup()
    host, _, port = args.listen.rpartition(":")
    await web.TCPSite(runner, host, int(port)).start()
    # The port bound, which port 0 leaves to the system: the line below says it.
    bound_host, bound_port = runner.addresses[0][:2]
    if ":" in bound_host:
        bound_host = f"[{bound_host}]"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"wake receiver on http://{bound_host}:{bound_port}/wake", file=sys.stderr, flush=True)
    try:
        await stop.wait()
        print("stopping: the engines started here go too", file=sys.stderr, flush=True)
    finally:
        await receiver.stop(args.stop_grace_seconds)
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
