"""`router ctl top`: a live view of one router, read from its admin API each second.

Like top and k9s: a header with the router's own rates, a row per model
(replicas ready, in flight, queued, held), a row per replica (state, in
flight, requests and errors per second, proven quiet time, last use) and,
once answers have said their tokens, a row per tenant (tokens per second,
and its prompt, cached and completion tokens and unknown answers so far). Keys
sort the replicas; `q` quits. Without a terminal it prints plain frames, one
each interval, as `top -b` does; `--once` prints one and exits.

Rates are the difference between two reads of the replicas' counters, so
the first frame has none ("-", unknown), except with --once, which reads
twice an interval apart. Like the other ctl commands it imports only the
standard library: curses for the terminal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.tools.ctl import Client, CtlError, human_duration

# Key -> (column name shown in the header, field of a Row). Numbers sort biggest first, text A to Z.
SORT_KEYS: dict[str, tuple[str, str]] = {
    "i": ("id", "id"),
    "m": ("model", "model"),
    "s": ("state", "state"),
    "f": ("in flight", "in_flight"),
    "r": ("req/s", "requests_per_second"),
    "e": ("err/s", "errors_per_second"),
    "t": ("quiet", "quiet_for_seconds"),
    "l": ("last used", "last_used_seconds_ago"),
}
SORT_NAMES = {name.replace(" ", "-").replace("/", "-per-"): key for key, (name, _) in SORT_KEYS.items()}
TEXT_FIELDS = {"id", "model", "state"}
STATE_ORDER = ("ready", "ejected", "draining", "drained")
MIN_WIDTH = 60


@dataclass(frozen=True, slots=True)
class Row:
    """One replica as the view shows it; None is unknown (no rate yet, never used, nothing proven)."""

    id: str
    model: str
    state: str
    in_flight: int
    requests_per_second: float | None
    errors_per_second: float | None
    quiet_for_seconds: float | None
    last_used_seconds_ago: float | None
    # What its engine last said (docs/routing.md): its queue, its KV cache use (0..1), the
    # reading's age; None: not read (or not said), and the columns show only when one is.
    engine_waiting: float | None = None
    engine_kv: float | None = None
    reading_age_seconds: float | None = None
    saturated: bool = False


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One model's row of router ctl top."""

    model: str
    ready: int
    total: int
    in_flight: int
    queued: int
    held: int
    oldest_held_seconds: float | None
    requests_per_second: float | None


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant's tokens (GET /api/v1/status `tenants`); its rate None until two reads."""

    tenant: str
    tokens_per_second: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    unknown_requests: int


@dataclass(frozen=True, slots=True)
class Frame:
    """One screen of router ctl top, made from one snapshot of the documents."""

    router: str
    generated_at: float
    watching_since: float
    replicas: tuple[Row, ...]
    models: tuple[ModelRow, ...]
    unserved: Mapping[str, int] = field(default_factory=dict)
    tenants: tuple[TenantRow, ...] = ()
    # Set when this read failed: the frame is the last good one, said to be stale.
    problem: str = ""

    def totals(self) -> dict[str, Any]:
        def total(values: Sequence[float | None]) -> float | None:
            return None if any(v is None for v in values) else sum(v for v in values if v is not None)

        states: dict[str, int] = {}
        for r in self.replicas:
            states[r.state] = states.get(r.state, 0) + 1
        return {
            "requests_per_second": total([r.requests_per_second for r in self.replicas]),
            "errors_per_second": total([r.errors_per_second for r in self.replicas]),
            "in_flight": sum(r.in_flight for r in self.replicas),
            "queued": sum(m.queued for m in self.models),
            "held": sum(m.held for m in self.models),
            "states": states,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "generated_at": self.generated_at,
            "totals": self.totals(),
            "models": [_fields(m) for m in self.models],
            "replicas": [_fields(r) for r in self.replicas],
            "unserved": dict(self.unserved),
            "tenants": [_fields(t) for t in self.tenants],
        }


def _fields(obj: Row | ModelRow | TenantRow) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def build_frame(
    rows: Sequence[Mapping[str, Any]],
    status: Mapping[str, Any],
    *,
    previous: Mapping[str, Mapping[str, Any]] | None,
    elapsed: float | None,
    previous_tokens: Mapping[str, int] | None = None,
) -> Frame:
    """A frame from GET /api/v1/status?replicas=true (rows and summary of one snapshot); rates from
    `previous` rows (and each tenant's `previous_tokens`, prompt and completion) read `elapsed` s before."""
    now = status["generated_at"]
    replicas = []
    for r in rows:
        before = (previous or {}).get(r["id"])
        rate = error_rate = None
        if before is not None and elapsed and before["model"] == r["model"]:
            # A counter that went down is another replica under the same id (a restarted router): unknown.
            if r["requests"] >= before["requests"]:
                rate = (r["requests"] - before["requests"]) / elapsed
            if r.get("errors", 0) >= before.get("errors", 0):
                error_rate = (r.get("errors", 0) - before.get("errors", 0)) / elapsed
        last_used = r["last_used"]
        load = r.get("engine_load") or {}
        replicas.append(
            Row(
                id=r["id"],
                model=r["model"],
                state=r["state"],
                in_flight=r["in_flight"],
                requests_per_second=rate,
                errors_per_second=error_rate,
                quiet_for_seconds=r.get("quiet_for_seconds"),
                last_used_seconds_ago=None if last_used is None else max(0.0, now - last_used),
                engine_waiting=load.get("waiting"),
                engine_kv=load.get("kv_cache_usage"),
                reading_age_seconds=load.get("age_seconds"),
                saturated=bool(r.get("saturated")),
            )
        )
    held = {h["model"]: h for h in status.get("held", [])}
    by_model = {m["model"]: m for m in status["models"]}
    models = []
    for name in sorted(set(by_model) | set(held)):
        m = by_model.get(name, {})
        h = held.get(name, {})
        rates = [r.requests_per_second for r in replicas if r.model == name]
        models.append(
            ModelRow(
                model=name,
                ready=m.get("ready", 0),
                total=m.get("total", 0),
                in_flight=m.get("in_flight", 0),
                queued=m.get("queued", 0),
                held=h.get("held", 0),
                oldest_held_seconds=h.get("oldest_waited_seconds"),
                requests_per_second=None if any(x is None for x in rates) else sum(x for x in rates if x is not None),
            )
        )
    tenants = []
    for t in status.get("tenants", []):
        tokens = t["prompt_tokens"] + t["completion_tokens"]
        tokens_before = (previous_tokens or {}).get(t["tenant"])
        rate = None
        if tokens_before is not None and elapsed and tokens >= tokens_before:
            rate = (tokens - tokens_before) / elapsed
        fields = ("prompt_tokens", "cached_tokens", "completion_tokens", "unknown_requests")
        tenants.append(TenantRow(t["tenant"], rate, *(t[name] for name in fields)))
    return Frame(
        router=status["router"],
        generated_at=now,
        watching_since=status["watching_since"],
        replicas=tuple(replicas),
        models=tuple(models),
        unserved=dict(status.get("unserved", {})),
        tenants=tuple(tenants),
    )


def tokens_by_tenant(status: Mapping[str, Any]) -> dict[str, int]:
    """Each tenant's prompt and completion tokens in a status document: the next frame's rates start here."""
    return {t["tenant"]: t["prompt_tokens"] + t["completion_tokens"] for t in status.get("tenants", [])}


def sort_rows(rows: Sequence[Row], key: str, *, reverse: bool = False) -> list[Row]:
    """By the field of `key` (a SORT_KEYS key); unknown values always last, ties by model then id."""
    name = SORT_KEYS[key][1]
    ordered = sorted(rows, key=lambda r: (r.model, r.id))
    known = [r for r in ordered if getattr(r, name) is not None]
    unknown = [r for r in ordered if getattr(r, name) is None]
    descending = name not in TEXT_FIELDS
    known.sort(key=lambda r: getattr(r, name), reverse=descending != reverse)
    return known + unknown


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _fit(cells: Sequence[str], widths: Sequence[int], right: Sequence[bool]) -> str:
    out = []
    for cell, width, align_right in zip(cells, widths, right, strict=True):
        text = cell if len(cell) <= width else cell[: max(1, width - 1)] + "~"
        out.append(text.rjust(width) if align_right else text.ljust(width))
    return "  ".join(out).rstrip()


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool], width: int, shrink: Sequence[int]
) -> list[str]:
    """Columns as wide as their cells, the `shrink` ones cut (with ~) until the table fits `width`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    while sum(widths) + 2 * (len(widths) - 1) > width and any(widths[i] > 6 for i in shrink):
        widest = max(shrink, key=lambda i: widths[i])
        widths[widest] -= 1
    return [_fit(headers, widths, right)] + [_fit(r, widths, right) for r in rows]


def render(
    frame: Frame, *, width: int = 80, sort: str = "m", reverse: bool = False, now: float | None = None
) -> list[str]:
    """The screen as lines, none longer than `width`."""
    width = max(width, MIN_WIDTH)
    totals = frame.totals()
    order = {state: i for i, state in enumerate(STATE_ORDER)}
    states = ", ".join(
        f"{n} {state}" for state, n in sorted(totals["states"].items(), key=lambda s: (order.get(s[0], 9), s[0]))
    )
    clock = time.strftime("%H:%M:%S", time.localtime(frame.generated_at))
    up = human_duration((now if now is not None else frame.generated_at) - frame.watching_since)
    name, _ = SORT_KEYS[sort]
    direction = "reversed" if reverse else ("A-Z" if SORT_KEYS[sort][1] in TEXT_FIELDS else "most first")
    lines = [
        f"router {frame.router}  {clock}  watching {up}",
        f"replicas {len(frame.replicas)}: {states or 'none'}",
        f"req/s {_rate(totals['requests_per_second'])}  err/s {_rate(totals['errors_per_second'])}  "
        f"in flight {totals['in_flight']}  queued {totals['queued']}  held {totals['held']}",
    ]
    if frame.problem:
        lines.append(f"stale: {frame.problem}")
    lines.append("")
    lines += _table(
        ["MODEL", "READY", "IN-FLIGHT", "QUEUED", "HELD", "OLDEST-HELD", "REQ/S"],
        [
            [
                m.model,
                f"{m.ready}/{m.total}",
                str(m.in_flight),
                str(m.queued),
                str(m.held),
                human_duration(m.oldest_held_seconds),
                _rate(m.requests_per_second),
            ]
            for m in frame.models
        ],
        [False, True, True, True, True, True, True],
        width,
        [0],
    )
    if frame.unserved:
        asked = ", ".join(f"{model} ({n})" for model, n in sorted(frame.unserved.items()))
        lines.append(f"asked for, no replica: {asked}")
    lines.append("")
    # The engines' columns only where some engine's load is read: a fleet without them keeps its width.
    engines = any(r.reading_age_seconds is not None for r in frame.replicas)
    headers = ["ID", "MODEL", "STATE", "IN-FLT", "REQ/S", "ERR/S", "QUIET", "LAST-USED"]
    if engines:
        headers += ["QUEUE", "KV%", "READ"]
    rows = []
    for r in sort_rows(frame.replicas, sort, reverse=reverse):
        row = [
            r.id,
            r.model,
            r.state + ("*" if r.saturated else ""),
            str(r.in_flight),
            _rate(r.requests_per_second),
            _rate(r.errors_per_second),
            human_duration(r.quiet_for_seconds),
            "-" if r.last_used_seconds_ago is None else human_duration(r.last_used_seconds_ago) + " ago",
        ]
        if engines:
            row += [
                "-" if r.engine_waiting is None else f"{r.engine_waiting:g}",
                "-" if r.engine_kv is None else f"{100 * r.engine_kv:.0f}",
                "-" if r.reading_age_seconds is None else f"{r.reading_age_seconds:.1f}s",
            ]
        rows.append(row)
    lines += _table(headers, rows, [False, False, False, *([True] * (len(headers) - 3))], width, [0, 1])
    if any(r.saturated for r in frame.replicas):
        lines.append("* saturated: its engine's queue or KV cache is at its model's bounds")
    if frame.tenants:
        lines.append("")
        lines += _table(
            ["TENANT", "TOK/S", "PROMPT", "CACHED", "COMPLETION", "UNKNOWN"],
            [
                [
                    t.tenant,
                    _rate(t.tokens_per_second),
                    str(t.prompt_tokens),
                    str(t.cached_tokens),
                    str(t.completion_tokens),
                    str(t.unknown_requests),
                ]
                for t in frame.tenants
            ],
            [False, True, True, True, True, True],
            width,
            [0],
        )
    lines += ["", f"sort: {name} ({direction})  keys: " + " ".join(SORT_KEYS) + " sort (again: reverse), q quit"]
    return [line[:width] for line in lines]


class Sampler:
    """Reads the admin API; each frame's rates are from the read before it."""

    def __init__(self, client: Client, *, idle_for: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.idle_for = idle_for
        self.clock = clock
        self.previous: dict[str, Mapping[str, Any]] | None = None
        self.previous_tokens: dict[str, int] | None = None
        self.read_at: float | None = None
        self.last: Frame | None = None

    def sample(self) -> Frame:
        try:
            # One snapshot per frame: the rows and the summary of the same instant.
            status = self.client.call("GET", f"/api/v1/status?idle_for={self.idle_for:g}&replicas=true")
            rows = status.pop("replicas", None)
            if rows is None:
                # A router from before the extension: two reads, a tick apart at worst.
                rows = self.client.call("GET", "/api/v1/replicas")
        except CtlError as exc:
            if self.last is None:
                raise
            self.last = Frame(**{**_frame_fields(self.last), "problem": str(exc)})
            return self.last
        at = self.clock()
        elapsed = None if self.read_at is None else at - self.read_at
        frame = build_frame(rows, status, previous=self.previous, elapsed=elapsed, previous_tokens=self.previous_tokens)
        self.previous = {r["id"]: r for r in rows}
        self.previous_tokens = tokens_by_tenant(status)
        self.read_at = at
        self.last = frame
        return frame


def _frame_fields(frame: Frame) -> dict[str, Any]:
    return {name: getattr(frame, name) for name in frame.__slots__}


def _interactive(sampler: Sampler, args: argparse.Namespace) -> None:
    import curses  # noqa: PLC0415 (only with a terminal: a script's --once needs no curses)

    def loop(screen: Any) -> None:
        curses.curs_set(0)
        screen.timeout(100)
        sort, reverse = SORT_NAMES[args.sort], False
        frame = sampler.sample()
        next_read = time.monotonic() + args.interval
        while True:
            rows, cols = screen.getmaxyx()
            screen.erase()
            for y, line in enumerate(render(frame, width=cols - 1, sort=sort, reverse=reverse)[:rows]):
                header = line.startswith(("MODEL ", "ID "))
                screen.addnstr(y, 0, line, cols - 1, curses.A_REVERSE if header else curses.A_NORMAL)
            screen.refresh()
            key = screen.getch()
            if key in (ord("q"), ord("Q"), 27):
                return
            if 0 <= key < 256 and chr(key) in SORT_KEYS:
                reverse = not reverse if chr(key) == sort else False
                sort = chr(key)
            if time.monotonic() >= next_read:
                frame = sampler.sample()
                next_read = time.monotonic() + args.interval

    curses.wrapper(loop)


def cmd_top(args: argparse.Namespace) -> int:
    client = Client(args.server[0], token=args.token, timeout=args.timeout)
    sampler = Sampler(client, idle_for=args.idle_for)
    if args.once:
        sampler.sample()
        time.sleep(args.interval)
        frame = sampler.sample()
        if args.json:
            print(json.dumps(frame.as_json(), indent=2))
        else:
            print("\n".join(render(frame, width=_width(), sort=SORT_NAMES[args.sort])))
        return 0
    if sys.stdin.isatty() and sys.stdout.isatty():
        _interactive(sampler, args)
        return 0
    # No terminal: plain frames, as `top -b`, until interrupted.
    try:
        while True:
            frame = sampler.sample()
            print("\n".join(render(frame, width=_width(), sort=SORT_NAMES[args.sort])) + "\n", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _width() -> int:
    return shutil.get_terminal_size((80, 24)).columns


def add_parser(sub: Any, common: argparse.ArgumentParser, duration: Callable[[str], float]) -> None:
    top = sub.add_parser("top", parents=[common], help="a live view: models, replicas, rates; keys sort, q quits")
    top.add_argument("--once", action="store_true", help="print one frame (its rates over --interval) and exit")
    top.add_argument("--interval", type=duration, default=1.0, help="seconds between reads (default 1)")
    top.add_argument("--sort", choices=sorted(SORT_NAMES), default="model", help="the replicas' order (default model)")
    top.add_argument(
        "--idle-for", type=duration, default=duration("30m"), help="the status's idle window (default 30m)"
    )
    top.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router each read")
