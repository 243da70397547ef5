"""When a model is full: priority classes and tenants' shares of its queue, through the openai SDK."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from router.run.app import RouterServer
from router.tools.fake import FakeReplica
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import CHAT, get_json, in_flight, post, samples, scrape
from tests.support.clock import FakeClock
from tests.support.waiting import wait_for

KEYS = {
    "flood": {"key": "sk-flood", "tenant": "a", "priority": "batch"},
    # Kept as its SHA-256 alone, as an operator should.
    "chat": {"key_sha256": hashlib.sha256(b"sk-chat").hexdigest(), "tenant": "b"},
}


class Busy:
    """A router whose one replica takes one request at a time, kept busy until `free()`.

    The busy request stalls at the replica; once the test has queued what it
    wants, `free()` lets it go (its client leaves), and the queued requests
    reach the replica one at a time, in the order the queue gives them.
    """

    def __init__(self, fake: FakeReplica, server: RouterServer) -> None:
        self.fake = fake
        self.server = server
        self._busy: asyncio.Task[Any] | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    async def hold(self) -> None:
        self.fake.behaviour.stall = True
        self._busy = asyncio.create_task(
            post(
                self.server.client_url + "/v1/chat/completions",
                orjson.dumps(CHAT),
                {"Authorization": "Bearer sk-chat", "Content-Type": "application/json"},
            )
        )
        await wait_for(lambda: in_flight(self.server) == {"r0": 1} and len(self.fake.seen) == 1)
        self.fake.behaviour.stall = False

    def ask(self, name: str, key: str = "sk-chat", **extra: Any) -> None:
        """A chat completion through the SDK, its prompt `name`, queued behind the busy one."""

        async def one() -> Any:
            async with openai.AsyncOpenAI(
                base_url=self.server.client_url + "/v1", api_key=key, max_retries=0
            ) as client:
                return await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": name}], max_tokens=2, **extra
                )

        self.tasks.append(asyncio.create_task(one()))

    async def queued(self, count: int) -> None:
        await wait_for(lambda: self.server.pool.queues.waiting("m") == count)

    async def free(self) -> list[str]:
        """Let the busy one go and every queued one be served: their prompts, in the order they reached the replica."""
        assert self._busy is not None
        self._busy.cancel()
        await asyncio.gather(self._busy, return_exceptions=True)
        for answer in await asyncio.gather(*self.tasks):
            assert answer.choices[0].message.content == "tok0 tok1 "
        return [orjson.loads(seen.body)["messages"][0]["content"] for seen in self.fake.seen[1:]]


@pytest.fixture
def busy(start_fake: StartFake, start_router: StartRouter) -> Any:
    """`async with busy(**settings) as router`: a Busy router with KEYS (start_router stops it at the end)."""

    @contextlib.asynccontextmanager
    async def make(**settings: Any) -> AsyncIterator[Busy]:
        fake = await start_fake("m")
        server = await start_router(
            [replica_entry("r0", fake)], max_in_flight_per_replica=1, **{"api_keys": KEYS, **settings}
        )
        router = Busy(fake, server)
        await router.hold()
        yield router

    return make


async def test_an_interactive_request_goes_before_a_batch_tenants_flood(busy: Any) -> None:
    async with busy() as router:
        for i in range(5):
            router.ask(f"flood{i}", "sk-flood")
        await router.queued(5)
        router.ask("chat", "sk-chat")
        await router.queued(6)
        assert await router.free() == ["chat", "flood0", "flood1", "flood2", "flood3", "flood4"]


async def test_the_body_priority_lowers_a_request_and_reaches_the_engine_untouched(busy: Any) -> None:
    """vLLM's `priority` above 0 makes a request batch; the replica still sees it as sent."""
    async with busy() as router:
        router.ask("later-by-priority", extra_body={"priority": 3})
        await router.queued(1)
        router.ask("plain")
        await router.queued(2)
        assert await router.free() == ["plain", "later-by-priority"]
        sent = orjson.loads(router.fake.seen[2].body)
        assert sent["priority"] == 3


async def test_x_priority_lowers_a_request_and_never_raises_one(busy: Any) -> None:
    async with busy() as router:
        router.ask("lowered", "sk-chat", extra_headers={"X-Priority": "batch"})
        await router.queued(1)
        router.ask("not-raised", "sk-flood", extra_headers={"X-Priority": "interactive"})
        await router.queued(2)
        router.ask("interactive", "sk-chat")
        await router.queued(3)
        assert await router.free() == ["interactive", "lowered", "not-raised"]


async def test_a_batch_request_aged_past_max_queue_seconds_goes_before_later_interactive_ones(busy: Any) -> None:
    """Aging: a batch request that has waited its class's max_queue_seconds is served before a flood above it."""
    classes = [
        {"name": "interactive", "queue_timeout_seconds": 30},
        {"name": "batch", "queue_timeout_seconds": 30, "max_queue_seconds": 0.2},
    ]
    clock = FakeClock()
    async with busy(priority_classes=classes, clock=clock) as router:
        router.ask("aged", "sk-flood")
        await router.queued(1)
        # Past its class's max_queue_seconds on the router's clock before the flood comes.
        clock.advance(0.3)
        for i in range(3):
            router.ask(f"chat{i}", "sk-chat")
        await router.queued(4)
        assert await router.free() == ["aged", "chat0", "chat1", "chat2"]


async def test_without_keys_every_request_is_tenant_default_and_the_model_counts_all_it_queues(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """No api_keys: tenant `default`; the per-model queue and the usage map's demand read as before."""
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], max_in_flight_per_replica=1)
    router = Busy(fake, server)
    fake.behaviour.stall = True
    busy = asyncio.create_task(
        post(server.client_url + "/v1/chat/completions", orjson.dumps(CHAT), {"Content-Type": "application/json"})
    )
    await wait_for(lambda: in_flight(server) == {"r0": 1} and len(fake.seen) == 1)
    fake.behaviour.stall = False
    router.ask("plain", "anything")
    router.ask("lowered", "anything", extra_headers={"X-Priority": "batch"})
    await router.queued(2)
    assert server.ticker is not None
    server.ticker.tick()
    queued = samples(await scrape(server), "router_queued_requests")
    assert queued == {
        (("model", "m"), ("priority", "interactive"), ("tenant", "default")): 1.0,
        (("model", "m"), ("priority", "batch"), ("tenant", "default")): 1.0,
    }
    status = await get_json(server.admin_url + "/api/v1/status")
    assert [(m["model"], m["queued"]) for m in status["models"]] == [("m", 2)]
    # Queued requests found the model served: no demand for a missing model, as before.
    usage = await get_json(server.admin_url + "/api/v1/usage")
    assert usage["demand"] == {}
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)
    for answer in await asyncio.gather(*router.tasks):
        assert answer.choices[0].message.content == "tok0 tok1 "


async def test_tenants_share_freed_slots_in_proportion_to_their_weights(busy: Any) -> None:
    keys = {"heavy": {"key": "sk-heavy", "weight": 2}, "light": {"key": "sk-light"}}
    async with busy(api_keys={**KEYS, **keys}) as router:
        for i in range(8):
            router.ask(f"heavy{i}", "sk-heavy")
            router.ask(f"light{i}", "sk-light")
        await router.queued(16)
        order = await router.free()
        first_rounds = [name.rstrip("0123456789") for name in order[:9]]
        assert first_rounds.count("heavy") == 6 and first_rounds.count("light") == 3
        # FIFO within each tenant.
        assert [n for n in order if n.startswith("heavy")] == [f"heavy{i}" for i in range(8)]


async def test_a_tenant_past_its_queue_bound_gets_429_with_retry_after_and_others_still_queue(busy: Any) -> None:
    async with busy(max_queued_per_tenant=2) as router:
        router.ask("flood0", "sk-flood")
        router.ask("flood1", "sk-flood")
        await router.queued(2)
        async with openai.AsyncOpenAI(
            base_url=router.server.client_url + "/v1", api_key="sk-flood", max_retries=0
        ) as client:
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert refused.value.status_code == 429
        assert refused.value.response.headers["Retry-After"] == "1"
        error = refused.value.response.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
        assert "Tenant 'a'" in error["message"] and "sk-flood" not in error["message"]
        router.ask("chat", "sk-chat")
        await router.queued(3)
        assert await router.free() == ["chat", "flood0", "flood1"]


async def test_a_queued_requests_line_names_its_tenant_class_and_wait_never_its_key(busy: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "access.log"
    async with busy(access_log=str(log_path)) as router:
        for i in range(2):
            router.ask(f"flood{i}", "sk-flood", extra_headers={"X-Request-Id": f"flood{i}"})
        await router.queued(2)
        await router.free()
        router.ask("at-once", "sk-chat", extra_headers={"X-Request-Id": "at-once"})
        await asyncio.gather(*router.tasks)

        def lines() -> dict[str, Any]:
            text = log_path.read_text() if log_path.exists() else ""
            return {doc["id"]: doc for doc in map(orjson.loads, text.splitlines())}

        await wait_for(lambda: {"flood0", "flood1", "at-once"} <= set(lines()))
        by_id = lines()
        for name in ("flood0", "flood1"):
            line = by_id[name]
            assert (line["tenant"], line["priority"], line["status"]) == ("a", "batch", 200)
            assert line["queued_seconds"] > 0
        # Served at once: its tenant, and no queue.
        assert by_id["at-once"]["tenant"] == "b"
        assert by_id["at-once"]["priority"] is None and by_id["at-once"]["queued_seconds"] is None
        assert "sk-" not in log_path.read_text()


async def test_the_queue_shows_by_class_and_tenant_in_metrics_status_and_ctl_never_a_key(
    busy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import io

    from router.tools import ctl

    caplog.set_level(logging.DEBUG)
    async with busy() as router:
        server = router.server
        for i in range(3):
            router.ask(f"flood{i}", "sk-flood")
        router.ask("chat", "sk-chat", extra_headers={"X-Priority": "batch"})
        await router.queued(4)
        assert server.ticker is not None
        server.ticker.tick()
        text = await scrape(server)
        batch_a = (("model", "m"), ("priority", "batch"), ("tenant", "a"))
        batch_b = (("model", "m"), ("priority", "batch"), ("tenant", "b"))
        assert samples(text, "router_queued_requests") == {batch_a: 3.0, batch_b: 1.0}

        def run(*args: str) -> str:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert ctl.main(list(args)) == 0
            return out.getvalue()

        doc = orjson.loads(await asyncio.to_thread(run, "status", "--server", server.admin_url, "--json"))
        assert [(q["priority"], q["tenant"], q["queued"]) for q in doc["queue"]] == [
            ("batch", "a", 3),
            ("batch", "b", 1),
        ]
        assert all(q["oldest_waited_seconds"] >= 0 for q in doc["queue"])
        status = await asyncio.to_thread(run, "status", "--server", server.admin_url)
        section = status.split("queued at the limits, by priority class and tenant:", 1)[1].splitlines()
        assert section[1].split() == ["MODEL", "PRIORITY", "TENANT", "QUEUED", "OLDEST-WAITING"]
        assert [row.split()[:4] for row in section[2:4]] == [["m", "batch", "a", "3"], ["m", "batch", "b", "1"]]
        await router.free()
        server.ticker.tick()
        text = await scrape(server)
        # An emptied queue is a fact: its series stay, at 0.
        assert samples(text, "router_queued_requests") == {batch_a: 0.0, batch_b: 0.0}
        waits = samples(text, "router_queue_wait_seconds_count")
        assert waits == {(("model", "m"), ("priority", "batch")): 4.0}
        after = await asyncio.to_thread(run, "status", "--server", server.admin_url)
        assert "queued at the limits" not in after
        admin = [
            orjson.dumps(await get_json(server.admin_url + path)).decode()
            for path in ("/api/v1/status", "/api/v1/usage", "/api/v1/replicas", "/api/v1/endpoints")
        ]
        # Neither a key nor its digest, anywhere an operator looks: only the tenants' names.
        told = "\n".join([text, status, after, *admin, caplog.text])
        for secret in ("sk-", hashlib.sha256(b"sk-chat").hexdigest(), hashlib.sha256(b"sk-flood").hexdigest()):
            assert secret not in told
