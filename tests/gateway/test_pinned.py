"""A request that continues a response waits for the replica that keeps it while that replica is only busy.

`previous_response_id` and `/v1/responses/{id}` must reach the replica that
made the response. At `max_in_flight_per_replica` that replica is busy, not
gone: the request waits in its queue like any other (503 server_overloaded
after `queue_timeout_seconds`), and 404 response_not_found means only that
the replica is gone (removed, draining, ejected), found at once or while it
waits. Through the real server with the official `openai` SDK; the queue's
deadline on a fake clock.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from router.run.app import RouterServer
from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, samples, scrape
from tests.support.clock import FakeClock
from tests.support.waiting import wait_for


def sdk(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.client_url + "/v1", api_key="x", max_retries=0, timeout=30)


async def occupy(server: RouterServer, session: aiohttp.ClientSession) -> aiohttp.ClientResponse:
    """A stream that holds the only slot of the replica until the test closes it."""
    resp = await session.post(server.client_url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    await resp.content.readany()  # under way: its slot is taken
    return resp


@dataclass
class Keeper:
    """A router whose one replica keeps a response and takes one request at a time; its clock is fake."""

    server: RouterServer
    response_id: str
    clock: FakeClock
    access_log: Path


@pytest.fixture
async def keeper(start_fake: StartFake, start_router: StartRouter, tmp_path: Path) -> Keeper:
    fake = await start_fake("m", behaviour=Behaviour(tokens=1000, token_delay=0.01))
    clock = FakeClock()
    access_log = tmp_path / "access.log"
    server = await start_router(
        [replica_entry("r0", fake)],
        max_in_flight_per_replica=1,
        queue_timeout_seconds=5,
        access_log=str(access_log),
        clock=clock,
    )
    async with sdk(server) as client:
        created = await client.responses.create(model="m", input="hi", max_output_tokens=2)
    return Keeper(server, created.id, clock, access_log)


async def test_a_previous_response_id_whose_replica_is_busy_waits_for_it_and_is_served(
    keeper: Keeper,
) -> None:
    server, response_id = keeper.server, keeper.response_id
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        turn = asyncio.create_task(
            client.responses.create(model="m", input="more", previous_response_id=response_id, max_output_tokens=2)
        )
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        assert not turn.done()
        stream.close()  # the slot frees: the waiting turn takes it
        answered = await turn
    assert answered.previous_response_id == response_id
    assert server.pool.queued() == {}


async def test_a_stored_response_read_while_its_replica_is_busy_waits_for_it(
    keeper: Keeper,
) -> None:
    server, response_id = keeper.server, keeper.response_id
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        read = asyncio.create_task(client.responses.retrieve(response_id))
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        stream.close()
        assert (await read).id == response_id


async def test_a_pinned_request_still_waiting_after_the_queue_timeout_gets_503_server_overloaded(
    keeper: Keeper,
) -> None:
    server, response_id = keeper.server, keeper.response_id
    clock = keeper.clock
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        turn = asyncio.create_task(client.responses.create(model="m", input="more", previous_response_id=response_id))
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        clock.advance(4.9)
        assert server.pool.queued() == {"m": 1}  # not before the timeout
        clock.advance(0.1)
        with pytest.raises(openai.InternalServerError) as refused:
            await turn
        stream.close()
    assert refused.value.status_code == 503
    assert refused.value.code == "server_overloaded"
    assert "keeps response" in refused.value.message
    assert server.ticker is not None
    server.ticker.tick()  # the tallies are read from the last tick's snapshot
    text = await scrape(server)
    assert samples(text, "router_overloaded_requests_total")[(("model", "m"),)] == 1
    assert samples(text, "router_queue_wait_seconds_count")[(("model", "m"), ("priority", "interactive"))] == 1


async def test_a_pinned_request_whose_replica_is_drained_while_it_waits_gets_404(
    keeper: Keeper,
) -> None:
    server, response_id = keeper.server, keeper.response_id
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        turn = asyncio.create_task(client.responses.create(model="m", input="more", previous_response_id=response_id))
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        server.pool.set_draining("r0", True)
        stream.close()  # the replica's last request ends: the waiting one learns it is gone
        with pytest.raises(openai.NotFoundError) as gone:
            await turn
    assert gone.value.code == "response_not_found" and "gone" in gone.value.message


async def test_a_pinned_request_whose_client_leaves_while_it_waits_takes_no_slot(
    keeper: Keeper,
) -> None:
    server, response_id = keeper.server, keeper.response_id
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        turn = asyncio.create_task(client.responses.create(model="m", input="more", previous_response_id=response_id))
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        turn.cancel()
        await asyncio.gather(turn, return_exceptions=True)
        await wait_for(lambda: server.pool.queued() == {})
        stream.close()
        replica = server.pool.get("r0")
        assert replica is not None
        await wait_for(lambda: replica.in_flight == 0)
        # The slot is free for the next: a new turn is served at once.
        answered = await client.responses.create(
            model="m", input="again", previous_response_id=response_id, max_output_tokens=2
        )
    assert answered.previous_response_id == response_id


async def test_a_pinned_request_that_waited_logs_its_own_class_and_its_wait(keeper: Keeper) -> None:
    """Lowered to batch by its header, it waits with batch's timeout and says so, as a queued request does."""
    server, response_id, log_path = keeper.server, keeper.response_id, keeper.access_log
    async with aiohttp.ClientSession() as session, sdk(server) as client:
        stream = await occupy(server, session)
        turn = asyncio.create_task(
            client.responses.create(
                model="m",
                input="more",
                previous_response_id=response_id,
                max_output_tokens=2,
                extra_headers={"X-Priority": "batch"},
            )
        )
        await wait_for(lambda: server.pool.queued() == {"m": 1})
        stream.close()
        await turn

    def waited() -> dict[str, Any] | None:
        lines = log_path.read_text().splitlines() if log_path.exists() else []
        found = [doc for doc in map(json.loads, lines) if doc["queued_seconds"] is not None]
        return found[0] if found else None

    await wait_for(lambda: waited() is not None)
    line = waited()
    assert line is not None
    assert line["path"] == "/v1/responses"
    assert line["priority"] == "batch"
    assert line["queued_seconds"] > 0
