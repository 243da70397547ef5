"""OpenTelemetry traces through `router serve`, read back by a local OTLP/HTTP receiver that decodes them.

The official `openai` and `anthropic` SDKs are the clients; a fake replica
records the traceparent it is sent, which must be the router's attempt span
(so that an engine's own spans, vLLM's with --otlp-traces-endpoint, join the
trace). The receiver is made hostile too: down, slow, answering 500; the
requests must not notice.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from pathlib import Path

import anthropic
import openai
import pytest

from router.tools.fake import Behaviour, FakeReplica
from tests.conftest import StartFake
from tests.support.clients import metrics, samples
from tests.support.otlp import STATUS_ERROR, OtlpReceiver, Span, otlp_receiver  # noqa: F401 (a fixture)
from tests.support.processes import Serve, free_port
from tests.support.waiting import until, wait_for

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@pytest.fixture(autouse=True)
def quick_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch processor's delay (the SDK's own variable, read by the router's process): spans
    reach the receiver a moment after their request, not five seconds."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")


def tracing(endpoint: str, **settings: object) -> str:
    lines = ["[tracing]", f'endpoint = "{endpoint}"']
    for key, value in settings.items():
        lines.append(f"{key} = {value!r}".replace("'", '"'))
    return "\n".join(lines)


async def serving(serve: Serve, fakes: list[FakeReplica], extra: str) -> None:
    serve.write([{"id": f"r{i}", "model": f.models[0], "url": f.url} for i, f in enumerate(fakes)], extra)
    await serve.start()


def openai_client(serve: Serve) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=serve.client_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def spans_of(receiver: OtlpReceiver, trace_id: str, count: int) -> list[Span]:
    await wait_for(lambda: len(receiver.trace(trace_id)) >= count, timeout=15)
    return receiver.trace(trace_id)


def sent_traceparent(fake: FakeReplica, index: int = -1) -> tuple[str, str, str]:
    headers = {name.lower(): value for name, value in fake.seen[index].headers.items()}
    found = TRACEPARENT.fullmatch(headers["traceparent"])
    assert found is not None, headers["traceparent"]
    # The flags' lowest bit says sampled (W3C Trace Context); the SDK sets the random-id bit beside it.
    return found.group(1), found.group(2), str(int(found.group(3), 16) & 1)


async def test_a_chat_request_is_a_server_span_and_its_attempt_a_client_span_the_engine_continues(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver
) -> None:
    fake = await start_fake("m")
    await serving(serve, [fake], "count_tokens = true\n" + tracing(otlp.url, service_name="router-test"))
    async with openai_client(serve) as client:
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=3
        )
    assert answer.choices[0].message.content == "tok0 tok1 tok2 "
    trace_id, parent, flags = sent_traceparent(fake)
    assert flags == "1"
    spans = await spans_of(otlp, trace_id, 2)
    (root,) = [s for s in spans if s.kind == "server"]
    (attempt,) = [s for s in spans if s.kind == "client"]
    assert root.name == "chat m" and attempt.name == "chat m"
    assert root.parent_id == ""
    assert attempt.parent_id == root.span_id
    # What the replica was sent is the attempt's own context: vLLM's spans become its children.
    assert parent == attempt.span_id
    assert root.resource["service.name"] == "router-test"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.provider.name"] == "openai"
    assert root.attributes["gen_ai.request.model"] == "m"
    assert root.attributes["gen_ai.response.model"] == "m"
    assert root.attributes["gen_ai.usage.input_tokens"] == 4
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["router.tenant"] == "default"
    assert root.attributes["router.attempts"] == 1
    assert root.attributes["router.replica.id"] == "r0"
    assert attempt.attributes["router.replica.id"] == "r0"
    assert attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["gen_ai.request.model"] == "m"
    assert attempt.attributes["server.address"] == "127.0.0.1"
    assert attempt.attributes["server.port"] == int(fake.url.rsplit(":", 1)[1])
    assert "first_byte" in attempt.events
    assert root.start <= attempt.start <= attempt.end <= root.end


async def test_the_clients_traceparent_is_continued_and_its_tracestate_passed_on(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver
) -> None:
    fake = await start_fake("m")
    await serving(serve, [fake], tracing(otlp.url))
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    async with openai_client(serve) as client:
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            stream=True,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01", "tracestate": "vendor=abc"},
        )
    sent_trace, parent, _ = sent_traceparent(fake)
    assert sent_trace == trace_id
    assert parent != client_span
    headers = {name.lower(): value for name, value in fake.seen[-1].headers.items()}
    assert headers["tracestate"] == "vendor=abc"
    spans = await spans_of(otlp, trace_id, 2)
    (root,) = [s for s in spans if s.kind == "server"]
    assert root.parent_id == client_span
    (attempt,) = [s for s in spans if s.kind == "client"]
    assert attempt.span_id == parent


async def test_an_anthropic_request_is_traced_with_its_tokens(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver
) -> None:
    fake = await start_fake("m")
    await serving(serve, [fake], "count_tokens = true\n" + tracing(otlp.url))
    async with anthropic.AsyncAnthropic(base_url=serve.client_url, api_key="unused", max_retries=0) as client:
        message = await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hello"}])
    assert message.usage.output_tokens == 5
    trace_id, parent, _ = sent_traceparent(fake)
    spans = await spans_of(otlp, trace_id, 2)
    (root,) = [s for s in spans if s.kind == "server"]
    assert root.name == "chat m"
    assert root.attributes["gen_ai.provider.name"] == "anthropic"
    assert root.attributes["url.path"] == "/v1/messages"
    assert root.attributes["gen_ai.usage.input_tokens"] == message.usage.input_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert [s.span_id for s in spans if s.kind == "client"] == [parent]


async def test_each_attempt_is_a_span_with_its_replica_and_status(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver
) -> None:
    """m's one replica answers 503; the request falls back to n's: two attempts, each its own span."""
    busy = await start_fake("m", behaviour=Behaviour(fail_status=503))
    fine = await start_fake("n")
    await serving(serve, [busy, fine], '[models.m]\nfallbacks = ["n"]\n' + tracing(otlp.url))
    async with openai_client(serve) as client:
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
    assert answer.choices[0].message.content == "tok0 tok1 "
    first_trace, first_parent, _ = sent_traceparent(busy)
    second_trace, second_parent, _ = sent_traceparent(fine)
    assert first_trace == second_trace and first_parent != second_parent
    spans = await spans_of(otlp, first_trace, 3)
    (root,) = [s for s in spans if s.kind == "server"]
    attempts = {s.span_id: s for s in spans if s.kind == "client"}
    refused, served = attempts[first_parent], attempts[second_parent]
    assert refused.parent_id == served.parent_id == root.span_id
    assert refused.name == "chat m" and served.name == "chat n"
    assert refused.attributes["router.replica.id"] == "r0"
    assert refused.attributes["http.response.status_code"] == 503
    assert refused.attributes["error.type"] == "503"
    assert refused.status == STATUS_ERROR
    assert served.attributes["router.replica.id"] == "r1"
    assert served.attributes["http.response.status_code"] == 200
    assert refused.end <= served.start
    assert root.attributes["gen_ai.request.model"] == "m"
    assert root.attributes["gen_ai.response.model"] == "n"
    assert root.attributes["router.attempts"] == 2


async def test_a_wait_at_the_limits_is_a_queue_span(start_fake: StartFake, serve: Serve, otlp: OtlpReceiver) -> None:
    fake = await start_fake("m")
    await serving(serve, [fake], "max_in_flight_per_replica = 1\nqueue_timeout_seconds = 30\n" + tracing(otlp.url))
    fake.behaviour.stall = True
    async with openai_client(serve) as client:
        busy = asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=2)
        )
        await wait_for(lambda: len(fake.seen) == 1, timeout=10)
        waiting = asyncio.create_task(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}], max_tokens=2)
        )
        # The second waits in the router's queue until the first's client leaves.
        key = (("model", "m"), ("priority", "interactive"), ("tenant", "default"))

        async def queued() -> bool:
            return samples(await metrics(serve.admin_url), "router_queued_requests").get(key) == 1

        await until(queued, timeout=10)
        fake.behaviour.stall = False
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await waiting
    trace_id, _, _ = sent_traceparent(fake)
    spans = await spans_of(otlp, trace_id, 3)
    (queue,) = [s for s in spans if s.name == "router.queue"]
    (root,) = [s for s in spans if s.kind == "server"]
    assert queue.kind == "internal" and queue.parent_id == root.span_id
    assert queue.attributes == {"router.priority": "interactive", "router.queue.served": True}
    assert root.attributes["router.priority"] == "interactive"
    assert root.attributes["router.queue.wait_seconds"] > 0


async def test_at_sample_ratio_0_nothing_is_exported_but_the_context_still_goes_on(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver
) -> None:
    """Unsampled, the replica still gets a traceparent (flags 00) of the same trace as the client's; a
    client's sampled trace is followed whatever the ratio, and it is the only one the receiver gets."""
    fake = await start_fake("m")
    await serving(serve, [fake], tracing(otlp.url, sample_ratio=0.0))
    unsampled, sampled = secrets.token_hex(16), secrets.token_hex(16)
    async with openai_client(serve) as client:
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1)
        plain_trace, _, plain_flags = sent_traceparent(fake)
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            extra_headers={"traceparent": f"00-{unsampled}-{secrets.token_hex(8)}-00"},
        )
        assert sent_traceparent(fake)[0] == unsampled and sent_traceparent(fake)[2] == "0"
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            extra_headers={"traceparent": f"00-{sampled}-{secrets.token_hex(8)}-01"},
        )
    assert plain_flags == "0"
    await spans_of(otlp, sampled, 2)
    # Spans are exported in the order they end: the sampled trace's came after every other request's.
    assert {span.trace_id for span in otlp.spans} == {sampled}
    assert plain_trace != sampled


@pytest.mark.parametrize("mode", ["down", "slow", "fail"])
async def test_a_collector_down_slow_or_failing_costs_spans_never_a_request(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver, mode: str
) -> None:
    fake = await start_fake("m")
    endpoint = f"http://127.0.0.1:{free_port()}/v1/traces" if mode == "down" else otlp.url
    otlp.mode = mode
    await serving(serve, [fake], tracing(endpoint, timeout_seconds=0.5, max_queue_size=8))
    async with openai_client(serve) as client:
        for i in range(40):
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2, stream=i % 2 == 1
            )
            if i % 2 == 0:
                assert answer.choices[0].message.content == "tok0 tok1 "  # type: ignore[union-attr]
            else:
                assert [chunk async for chunk in answer]  # type: ignore[union-attr]
    assert len(fake.seen) == 40
    if mode != "down":
        # The exports did reach it, and were refused or left hanging.
        await wait_for(lambda: otlp.posts >= 1, timeout=10)
    assert otlp.spans == []


async def test_tracing_configured_without_the_extra_is_one_line_naming_the_install(
    tmp_path: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenTelemetry hidden from the router's process by an empty package of its name, first on its path."""
    hidden = tmp_path / "hidden"
    (hidden / "opentelemetry").mkdir(parents=True)
    (hidden / "opentelemetry" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(hidden))
    serve.write([], tracing("http://127.0.0.1:4318"))
    with pytest.raises(AssertionError):
        await serve.start()
    out = serve.output()
    assert "tracing: [tracing] needs OpenTelemetry's SDK and OTLP/HTTP exporter" in out
    assert "pip install 'router[tracing]'" in out


@pytest.mark.parametrize(
    ("table", "said"),
    [
        (
            '[tracing]\nendpoint = "http://127.0.0.1:4318"\nsample_rate = 0.5',
            "tracing.sample_rate: unknown key (did you mean 'sample_ratio'?)",
        ),
        ('[tracing]\nservice_name = "r"', "tracing.endpoint: is required in [tracing]"),
        (
            '[tracing]\nendpoint = "http://127.0.0.1:4318"\nsample_ratio = 2',
            "tracing.sample_ratio: must be between 0 and 1",
        ),
        ('[tracing]\nendpoint = "collector:4318"', "tracing.endpoint: must start with http:// or https://"),
        (
            '[tracing]\nendpoint = "http://c:4318"\nheaders = { "bad name" = "x" }',
            "tracing.headers.bad name: is not a header name",
        ),
        ('[tracng]\nendpoint = "http://c:4318"', "tracng: unknown key (did you mean 'tracing'?)"),
    ],
)
async def test_a_tracing_mistake_is_one_line_naming_the_key(serve: Serve, table: str, said: str) -> None:
    serve.write([], table)
    with pytest.raises(AssertionError):
        await serve.start()
    assert said in serve.output()


@pytest.mark.parametrize(
    "sent",
    [
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
    ],
)
async def test_a_malformed_traceparent_begins_a_trace_of_the_routers_own(
    start_fake: StartFake, serve: Serve, otlp: OtlpReceiver, sent: str
) -> None:
    """What W3C Trace Context says a receiver must not accept is ignored: a new trace, never an error."""
    fake = await start_fake("m")
    await serving(serve, [fake], tracing(otlp.url))
    async with openai_client(serve) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_headers={"traceparent": sent}
        )
    trace_id, parent, sampled = sent_traceparent(fake)
    assert trace_id not in sent and sampled == "1"
    spans = await spans_of(otlp, trace_id, 2)
    (root,) = [s for s in spans if s.kind == "server"]
    assert root.parent_id == ""
    assert [s.span_id for s in spans if s.kind == "client"] == [parent]


async def test_each_worker_traces_its_own_requests(start_fake: StartFake, serve: Serve, otlp: OtlpReceiver) -> None:
    """With --workers, every worker exports its requests' spans itself: a trace per request, whole."""
    fake = await start_fake("m")
    serve.write([{"id": "r0", "model": "m", "url": fake.url}], tracing(otlp.url))
    await serve.start("--workers", "2")
    async with openai_client(serve) as client:
        for i in range(6):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"{i}"}], max_tokens=1
            )
    traces = {sent_traceparent(fake, i)[0] for i in range(6)}
    assert len(traces) == 6
    for trace_id in traces:
        spans = await spans_of(otlp, trace_id, 2)
        assert sorted(s.kind for s in spans) == ["client", "server"]
