"""A real client's calls to a router: requests, its usage and admin documents, its metrics, `router ctl`.

Nothing here fakes the router: these are the clients and probes the tests drive it with.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from router.run.app import RouterServer
from router.tools import ctl

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def in_flight(server: RouterServer) -> dict[str, int]:
    return {r.id: r.in_flight for r in server.pool}


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers or {"Content-Type": "application/json"}) as resp,
    ):
        return resp.status, resp.headers.copy(), await resp.read()


async def post_cut(url: str, body: bytes) -> tuple[int, bytes, bool]:
    """POST and read the answer as far as it goes: (status, body so far, whether it ended properly).

    A broken answer must look broken: the router closes it without the
    chunked last-chunk, which an HTTP library reports as an incomplete body.
    """
    received = bytearray()
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp,
    ):
        try:
            async for chunk in resp.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            return resp.status, bytes(received), False
        return resp.status, bytes(received), True


def access_log_lines(path: Path) -> list[dict[str, Any]]:
    """The access log's lines so far, parsed (none before the file is made)."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line] if path.exists() else []


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def scrape(server: RouterServer) -> str:
    async with aiohttp.ClientSession() as session, session.get(server.admin_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def run_ctl(*args: str) -> tuple[int, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = ctl.main(list(args))
    return code, buffer.getvalue()


async def metrics(admin_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as resp:
        return await resp.text()


async def metric(admin_url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One family's samples as `/metrics` at `admin_url` shows them now, by their sorted labels."""
    return samples(await metrics(admin_url), name)


async def protocol_errors(admin_url: str, side: str = "client") -> dict[str, float]:
    found = samples(await metrics(admin_url), f"router_{side}_protocol_errors_total")
    return {dict(labels)["reason"]: value for labels, value in found.items()}
