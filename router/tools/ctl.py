"""`router ctl`: read and steer running routers through their admin API.

Imports only the standard library and the core, so that it starts fast and
runs where the server's dependencies are not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from router.core.usage.snapshots import RouterReport, merge_reports

DEFAULT_SERVER = "127.0.0.1:9090"


class CtlError(Exception):
    """A problem to report in one line, exit status 1."""


def base_url(server: str) -> str:
    server = server.strip().rstrip("/")
    if not server:
        raise CtlError("--server must not be empty")
    if "://" not in server:
        return "http://" + server
    if not server.startswith(("http://", "https://")):
        raise CtlError(f"--server must be host:port or an http(s) URL, got {server!r}")
    return server


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '1h30m', '2d' into seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or parts is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1h30m)")
    days, hours, minutes, seconds = (float(p) if p else 0.0 for p in parts.groups())
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


class Client:
    """router ctl's client of one router's admin API, standard library only."""

    def __init__(self, server: str, *, token: str = "", timeout: float = 5.0) -> None:
        self.base = base_url(server)
        self.server = server
        self.token = token
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)  # noqa: S310 (base_url allows http(s) only)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:  # noqa: S310 (as above)
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            message, code = _error(exc)
            said = f"{self.server}: {method} {path} answered {exc.code}: {message}"
            raise CtlError(said + _hint(code, bool(self.token))) from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CtlError(f"{self.server}: cannot reach the admin API: {reason}") from exc
        except ValueError as exc:
            raise CtlError(f"{self.server}: {path} did not answer JSON: {exc}") from exc


def _error(exc: urllib.error.HTTPError) -> tuple[str, str | None]:
    """The message of an OpenAI-shaped error answer, and its code."""
    try:
        doc = json.loads(exc.read())
        code = doc["error"].get("code")
        return str(doc["error"]["message"]), code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return exc.reason or "error", None


def _hint(code: str | None, token_given: bool) -> str:
    """What to do about an answer whose code says what went wrong."""
    if code == "invalid_admin_token":
        if token_given:
            return " (the token given, by --token or ROUTER_ADMIN_TOKEN, is not this router's admin token)"
        return " (give the router's admin token with --token TOKEN, or in ROUTER_ADMIN_TOKEN)"
    if code in ("unknown_url", "invalid_api_key"):
        # Only the client port answers these: the admin API has no such codes.
        return (
            " (this is a router's client port, not its admin API: give --server the admin address, "
            f"admin_listen in its config, {DEFAULT_SERVER} unless it says otherwise)"
        )
    return ""


def _emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else text)


def cmd_replicas(args: argparse.Namespace) -> int:
    rows = Client(args.server[0], token=args.token).call("GET", "/api/v1/replicas")
    text = table(
        ["ID", "MODEL", "STATE", "IN-FLIGHT", "REQUESTS", "IDLE", "QUIET-FOR", "URL"],
        [
            [
                r["id"],
                r["model"],
                r["state"],
                r["in_flight"],
                r["requests"],
                # Negative idle_seconds is the API's "unknown": never shown as a duration.
                human_duration(r["idle_seconds"]) if r["idle_seconds"] >= 0 else "-",
                # The proven bound: the rule of `idle` and `status`.
                human_duration(r["quiet_for_seconds"]) if r.get("quiet_for_seconds") is not None else "-",
                r["url"],
            ]
            for r in rows
        ],
    )
    _emit(args, rows, text)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    doc = Client(args.server[0], token=args.token).call("GET", "/api/v1/usage")
    now = doc["generated_at"]
    ids = sorted(set(doc["watching_since"]) | set(doc["last_used"]))
    rows = []
    for rid in ids:
        last = doc["last_used"].get(rid)
        watching = doc["watching_since"].get(rid)
        rows.append(
            [
                rid,
                _clock(last),
                human_duration(now - last) if last is not None else "-",
                _clock(watching),
            ]
        )
    header = f"router {doc['router']}, started {_clock(doc['started_at'])}, snapshot {_clock(now)}"
    _emit(args, doc, header + "\n" + table(["ID", "LAST-USED", "IDLE", "WATCHING-SINCE"], rows))
    return 0


def _clock(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def cmd_idle(args: argparse.Namespace) -> int:
    reports: list[RouterReport | None] = []
    models: dict[str, str] = {}
    problems: list[str] = []
    for server in args.server:
        client = Client(server, token=args.token, timeout=args.timeout)
        try:
            doc = client.call("GET", "/api/v1/usage")
            # The map names each replica's model; a router from before it did needs the per-replica rows.
            named = doc.get("model")
            if named is None:
                named = {row["id"]: row["model"] for row in reversed(client.call("GET", "/api/v1/replicas"))}
        except CtlError as exc:
            problems.append(str(exc))
            reports.append(None)
            continue
        for rid, model in named.items():
            models.setdefault(rid, model)
        reports.append(
            RouterReport(
                server=server,
                last_used=doc["last_used"],
                watching_since=doc["watching_since"],
                generated_at=doc["generated_at"],
                held={model: d.get("held", 0) for model, d in doc.get("demand", {}).items()},
            )
        )
    merged = merge_reports(reports, now=time.time(), idle_for=args.idle_for, models=models)
    # The maps are the routers' last snapshots (one a tick): what they prove holds as of the
    # oldest of them, and a request since then is in none of them (ctl replicas shows it live).
    as_of = min((r.generated_at for r in reports if r is not None), default=None)
    doc = {
        "complete": merged.complete,
        "as_of": as_of,
        "candidates": [
            {"id": c.id, "model": c.model, "quiet_for_seconds": round(c.quiet_for_seconds, 3), "last_used": c.last_used}
            for c in merged.candidates
        ],
        "unknown": list(merged.unknown),
    }
    lines = [f"warning: {p}" for p in problems]
    if as_of is not None:
        lines.append(f"as of {_clock(as_of)}, the oldest snapshot among the routers")
    if not merged.complete:
        lines.append("incomplete: a router did not answer, so nothing can be proven idle")
    lines.append(
        table(
            ["ID", "MODEL", "QUIET-FOR", "LAST-USED"],
            [
                [c.id, c.model or "-", human_duration(c.quiet_for_seconds), _clock(c.last_used)]
                for c in merged.candidates
            ],
        )
        if merged.candidates
        else f"no replica is proven quiet for {human_duration(args.idle_for)}"
    )
    if merged.unknown:
        lines.append(f"unknown ({len(merged.unknown)}): " + ", ".join(merged.unknown))
    if args.json:
        for p in problems:
            print(f"warning: {p}", file=sys.stderr)
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(lines))
    return 0 if merged.complete else 3


def cmd_status(args: argparse.Namespace) -> int:
    doc = Client(args.server[0], token=args.token).call("GET", f"/api/v1/status?idle_for={args.idle_for:g}")
    window = human_duration(doc["idle_for_seconds"])
    parts = [
        f"router {doc['router']}, watching since {_clock(doc['watching_since'])}, snapshot "
        f"{_clock(doc['generated_at'])}, idle window {window}",
        "",
        table(
            ["MODEL", "READY", "EJECTED", "DRAINING", "ASLEEP", "IN-FLIGHT", "REQ/S", "ASKED"],
            [
                [
                    m["model"],
                    f"{m['ready']}/{m['total']}",
                    m["ejected"],
                    m["draining"],
                    m.get("asleep", 0),
                    m["in_flight"],
                    f"{m['requests_per_second']:.2f}",
                    m["asked"],
                ]
                for m in doc["models"]
            ],
        ),
        "",
        table(
            [
                "GPU-CLASS",
                "GPUS",
                "BUSY",
                "IDLE",
                "UNKNOWN",
                "EJECTED",
                "ASLEEP",
                "USAGE (#busy .idle ?unknown xejected zasleep)",
            ],
            [
                [
                    g["gpu_class"],
                    g["total"],
                    g["busy"],
                    g["idle"],
                    g["unknown"],
                    g["ejected"],
                    g.get("asleep", 0),
                    g["bar"],
                ]
                for g in doc["gpus"]
            ],
        ),
        "",
    ]
    parts += _fabric_lines(doc)
    if doc["unasked"]:
        parts += [
            f"unasked-for (proven quiet for at least {window}):",
            table(
                ["ID", "MODEL", "GPU-CLASS", "GPUS", "QUIET-FOR"],
                [
                    [u["id"], u["model"], u["gpu_class"], u["gpus"], human_duration(u["quiet_for_seconds"])]
                    for u in doc["unasked"]
                ],
            ),
        ]
    else:
        parts.append(f"unasked-for: none proven quiet for {window}")
    if doc.get("held"):
        parts += [
            "",
            "held, waiting for a replica that answers (scale from zero):",
            table(
                ["MODEL", "REPLICAS", "HELD", "OLDEST-WAITING"],
                [
                    [
                        h["model"],
                        h["replicas"],
                        h["held"],
                        "-" if h["oldest_waited_seconds"] is None else human_duration(h["oldest_waited_seconds"]),
                    ]
                    for h in doc["held"]
                ],
            ),
        ]
    if doc.get("queue"):
        parts += [
            "",
            "queued at the limits, by priority class and tenant:",
            table(
                ["MODEL", "PRIORITY", "TENANT", "QUEUED", "OLDEST-WAITING"],
                [
                    [
                        q["model"],
                        q["priority"],
                        q["tenant"],
                        q["queued"],
                        human_duration(q["oldest_waited_seconds"]),
                    ]
                    for q in doc["queue"]
                ],
            ),
        ]
    if doc.get("not_serving"):
        parts += [
            "",
            "not serving their model (their /v1/models does not list it; vLLM answers 404: --served-model-name):",
            table(["ID", "MODEL", "URL"], [[n["id"], n["model"], n["url"]] for n in doc["not_serving"]]),
        ]
    if doc["unserved"]:
        parts += [
            "",
            "asked for, no replica could serve:",
            table(["MODEL", "REQUESTS"], [[m, n] for m, n in doc["unserved"].items()]),
        ]
    _emit(args, doc, "\n".join(parts))
    return 0


def _fabric_lines(doc: dict[str, Any]) -> list[str]:
    """The whole nodes per fabric (status's `fabrics`): shown once some replica names its node."""
    fabrics, conflicts = doc.get("fabrics") or [], doc.get("node_conflicts") or []
    if not fabrics and not conflicts:
        return []
    lines = [
        "whole nodes per fabric (free: every replica on it asleep, drained or proven idle; ejected GPUs apart):",
        table(
            ["FABRIC", "NODES", "GPUS", "FREE-NODES", "FREE-GPUS", "EJECTED-GPUS"],
            [
                [f["fabric"] or "-", f["nodes"], f["gpus"], len(f["free_nodes"]), f["free_gpus"], f["ejected_gpus"]]
                for f in fabrics
            ],
        ),
    ]
    free = [(f["fabric"] or "-", n) for f in fabrics for n in f["free_nodes"]]
    if free:
        lines += [
            "",
            "whole nodes that could be freed now:",
            table(
                ["FABRIC", "NODE", "GPUS", "REPLICAS"],
                [[fabric, n["node"], n["gpus"], ", ".join(n["replicas"])] for fabric, n in free],
            ),
        ]
    no_node = doc.get("no_node") or {}
    if no_node.get("replicas"):
        lines.append(f"replicas naming no node: {no_node['replicas']} ({no_node['gpus']} GPUs), on no node above")
    for c in conflicts:
        lines.append(
            f"node {c['node']} is on fabrics {', '.join(c['fabrics'])} (replicas {', '.join(c['replicas'])}): "
            "counted on none"
        )
    return [*lines, ""]


def cmd_state(args: argparse.Namespace, state: str) -> int:
    client = Client(args.server[0], token=args.token)
    answer = client.call("POST", f"/api/v1/replicas/{quote(args.id, safe='')}/state", {"state": state})
    if state == "draining" and getattr(args, "wait", False):
        deadline = time.monotonic() + args.timeout_wait
        while answer["state"] != "drained":
            if time.monotonic() > deadline:
                raise CtlError(
                    f"{args.id}: still {answer['state']} with {answer['in_flight']} in flight after "
                    f"{human_duration(args.timeout_wait)}"
                )
            time.sleep(0.2)
            answer = next(r for r in client.call("GET", "/api/v1/replicas") if r["id"] == args.id)
    _emit(args, answer, f"{answer['id']}: {answer['state']} ({answer['in_flight']} in flight)")
    return 0


def cmd_sleep(args: argparse.Namespace) -> int:
    """Put a replica to sleep; with several routers, the fence spans them all before the one engine call.

    Phase one drains it in every router and waits until each has nothing in
    flight to it; phase two has the first router call the engine and tells
    the others that it sleeps. A failure in phase one or two, the telling
    included, puts it back to ready everywhere (woken, if its engine slept).
    """
    wait = args.timeout_wait
    # A sleep answers once drained and once the engine slept: longer than a read.
    clients = [Client(server, token=args.token, timeout=wait + _ENGINE_CALL_SECONDS) for server in args.server]
    path = f"/api/v1/replicas/{quote(args.id, safe='')}/state"
    if len(clients) > 1:
        try:
            for client in clients:
                client.call("POST", path, {"state": "draining"})
            deadline = time.monotonic() + wait
            for client in clients:
                while (row := _row(client, args.id))["state"] != "drained":
                    if time.monotonic() > deadline:
                        raise CtlError(
                            f"{args.id}: still {row['in_flight']} in flight at {client.base} after "
                            f"{human_duration(wait)}; not put to sleep"
                        )
                    time.sleep(0.05)
            answer = clients[0].call("POST", path, {"state": "asleep", "level": args.level, "wait_seconds": 0})
            # A router not told leaves the sleep half done (asleep at some, fenced at others): undone too.
            told = {"state": "asleep", "level": args.level, "call_engine": False, "wait_seconds": 0}
            for client in clients[1:]:
                client.call("POST", path, told)
        except CtlError:
            # The first router first: if it slept the engine, its wake is the one engine call,
            # and the others find the engine awake and make none.
            for client in clients:
                with contextlib.suppress(CtlError):
                    client.call("POST", path, {"state": "ready"})
            raise
    else:
        answer = clients[0].call("POST", path, {"state": "asleep", "level": args.level, "wait_seconds": wait})
    _emit(args, answer, f"{answer['id']}: {answer['state']} (level {answer['level']})")
    return 0


def cmd_wake(args: argparse.Namespace) -> int:
    """Wake a replica: one router calls its engine, the others are told it is ready."""
    clients = [Client(server, token=args.token, timeout=_ENGINE_CALL_SECONDS) for server in args.server]
    path = f"/api/v1/replicas/{quote(args.id, safe='')}/state"
    answer = clients[0].call("POST", path, {"state": "ready"})
    for client in clients[1:]:
        client.call("POST", path, {"state": "ready", "call_engine": False})
    _emit(args, answer, f"{answer['id']}: {answer['state']}")
    return 0


# What a router may take for an engine's sleep or wake call (its wake_timeout_seconds, 60 by default).
_ENGINE_CALL_SECONDS = 130.0


def _row(client: Client, replica_id: str) -> dict[str, Any]:
    for row in client.call("GET", "/api/v1/replicas"):
        if row["id"] == replica_id:
            return dict(row)
    raise CtlError(f"{client.base} has no replica {replica_id!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="router ctl", description="Read and steer running routers.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server",
        action="append",
        default=None,
        help=f"admin address, host:port or URL (default {DEFAULT_SERVER}); idle takes several",
    )
    common.add_argument("--json", action="store_true", help="print JSON for machines")
    common.add_argument(
        "--token", default=os.environ.get("ROUTER_ADMIN_TOKEN", ""), help="admin token (default: $ROUTER_ADMIN_TOKEN)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("replicas", parents=[common], help="one row per replica, with its IDLE time")
    sub.add_parser("usage", parents=[common], help="the usage map as the control plane polls it")
    status = sub.add_parser("status", parents=[common], help="the fleet summary: models, GPUs, what is unasked-for")
    status.add_argument(
        "--idle-for",
        type=parse_duration,
        default=parse_duration("30m"),
        help="quiet longer than this counts as idle (default 30m)",
    )
    idle = sub.add_parser("idle", parents=[common], help="merge several routers: what is provably quiet")
    idle.add_argument(
        "--idle-for",
        type=parse_duration,
        default=parse_duration("30m"),
        help="how long quiet counts as idle (default 30m)",
    )
    idle.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each router")
    drain = sub.add_parser("drain", parents=[common], help="stop new requests to a replica")
    drain.add_argument("id")
    drain.add_argument("--wait", action="store_true", help="return once nothing is in flight (drained)")
    drain.add_argument("--timeout-wait", type=parse_duration, default=parse_duration("10m"))
    undrain = sub.add_parser("undrain", parents=[common], help="put a drained replica back")
    undrain.add_argument("id")
    sleep = sub.add_parser(
        "sleep", parents=[common], help="drain a replica, then put its engine to sleep (several --server: all fenced)"
    )
    sleep.add_argument("id")
    sleep.add_argument("--level", type=int, choices=(1, 2), default=1, help="the engine's sleep level (default 1)")
    sleep.add_argument("--timeout-wait", type=parse_duration, default=parse_duration("1m"), help="drain at most this")
    wake = sub.add_parser("wake", parents=[common], help="wake a sleeping replica (several --server: all told)")
    wake.add_argument("id")
    # Imported here: top builds on this module's client.
    from router.tools import top  # noqa: PLC0415

    top.add_parser(sub, common, parse_duration)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.server:
        args.server = [DEFAULT_SERVER]
    try:
        if args.command == "replicas":
            return cmd_replicas(args)
        if args.command == "usage":
            return cmd_usage(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "idle":
            return cmd_idle(args)
        if args.command == "drain":
            return cmd_state(args, "draining")
        if args.command == "undrain":
            return cmd_state(args, "ready")
        if args.command == "sleep":
            return cmd_sleep(args)
        if args.command == "wake":
            return cmd_wake(args)
        if args.command == "top":
            from router.tools.top import cmd_top  # noqa: PLC0415 (as in build_parser)

            return cmd_top(args)
    except CtlError as exc:
        print(f"router ctl: {exc}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")
