"""Bodies nested as deep as a JSON reader allows: never a 500 where the router reads into them.

orjson reads 1,024 levels of nesting and writes 255; Python formats about
1,000 before RecursionError. Every field the router reads of a body (the
model, `previous_response_id`, the prompt and each message's role under
prefix routing) and every body it writes again (an alias's) must cope with
any of it: 400 for a value that cannot be what it claims, the odd field
ignored where it only feeds a hash.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from router.tools.fake import Behaviour
from tests.conftest import StartFake, StartRouter, replica_entry
from tests.support.clients import access_log_lines
from tests.support.waiting import wait_for
from tests.support.wire import CHAT, Wire, post

DEPTH = 1000


def deep(depth: int = DEPTH) -> bytes:
    """A JSON array nested `depth` deep: what orjson still reads, and repr() cannot print."""
    return b"[" * depth + b"]" * depth


def body_with(field: bytes, value: bytes, base: dict[str, object] | None = None) -> bytes:
    """`base` (a chat request) with `field` set to the raw JSON `value`."""
    prefix = orjson.dumps(base or CHAT)[:-1]
    return prefix + b',"' + field + b'":' + value + b"}"


async def test_a_deep_previous_response_id_is_a_400_that_names_the_field(
    start_fake: StartFake, start_router: StartRouter, tmp_path: Path
) -> None:
    fake = await start_fake("m")
    log = tmp_path / "access.log"
    server = await start_router([replica_entry("r0", fake)], access_log=str(log))
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(body_with(b"previous_response_id", deep()), path=b"/v1/responses"))
        answer = await wire.answer()
    assert answer.status == 400
    error = answer.json()["error"]
    assert isinstance(error, dict) and error["param"] == "previous_response_id"
    assert fake.seen == []
    await wait_for(lambda: len(access_log_lines(log)) == 1)
    assert [line["status"] for line in access_log_lines(log)] == [400]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            orjson.dumps({"model": "m", "messages": [{"role": "r", "content": "x"}]})[:-2]
            + b',{"role":'
            + deep()
            + b',"content":"hi"}]}',
            id="message-role",
        ),
        pytest.param(b'{"model":"m","prompt":[' + deep(DEPTH - 2) + b"]}", id="prompt-token-list"),
        pytest.param(b'{"model":"m","prompt":' + deep() + b"}", id="prompt"),
        pytest.param(b'{"model":"m","input":[{"role":' + deep(DEPTH - 3) + b"}]}", id="input-role"),
    ],
)
async def test_a_deep_field_under_prefix_routing_is_ignored_for_the_key_and_forwarded(
    start_fake: StartFake, start_router: StartRouter, body: bytes
) -> None:
    """The key is a hash of the prompt's text: a field that is not text adds nothing to it, and breaks nothing."""
    # The replica answers anything 200, unread: what is judged is the router's reading alone.
    fake = await start_fake("m", behaviour=Behaviour(fail_status=200, fail_body=b"{}"))
    server = await start_router([replica_entry("r0", fake)], models={"m": {"routing": "prefix"}})
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(body))
        answer = await wire.answer()
    assert answer.status == 200
    assert [seen.body for seen in fake.seen] == [body]


async def test_a_body_too_deep_to_rename_under_an_alias_is_a_400(
    start_fake: StartFake, start_router: StartRouter
) -> None:
    """orjson writes 255 levels, reads 1,024: an alias's body is written again under the model's name."""
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)], models={"m": {"aliases": ["alias"]}})
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(body_with(b"extra", deep(300), {**CHAT, "model": "alias"})))
        renamed = await wire.answer()
        # Under its own name the same body goes through untouched.
        own = body_with(b"extra", deep(300))
        wire.send(post(own))
        untouched = await wire.answer()
    assert renamed.status == 400
    assert "nested too deeply" in str(renamed.json()["error"])
    assert untouched.status == 200
    assert [seen.body for seen in fake.seen] == [own]


async def test_a_deep_model_name_is_a_400_not_a_500(start_fake: StartFake, start_router: StartRouter) -> None:
    fake = await start_fake("m")
    server = await start_router([replica_entry("r0", fake)])
    async with await Wire.open(server.client_address) as wire:
        wire.send(post(b'{"model":' + deep() + b',"messages":[]}'))
        answer = await wire.answer()
    assert answer.status == 400
    assert fake.seen == []
