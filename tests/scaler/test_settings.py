"""`router scaler`'s settings: the [scaler] table, the command line over it, and the mistakes it names.

Flags win over the file, the token falls back to the environment, a mistake
is one line naming its key (exit 2), a port in use is exit 1; the docs list
every key with its default and help. The rules on exact figures are test_rules.py's.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from router.core.config.settings import Address, load_config
from router.core.errors import ConfigError
from router.scaler.main import build_parser, settings_from
from router.scaler.settings import HELP, ScalerSettings, apply
from router.scaler.view import decide, parse_metadata


def settings_of(*argv: str, environ: dict[str, str] | None = None) -> Any:
    return settings_from(build_parser().parse_args(list(argv)), environ or {})


def test_flags_win_over_the_file_and_the_token_falls_back_to_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "scaler.toml"
    path.write_text(
        '[scaler]\nservers = ["a:9090", "http://b:9090"]\npoll_seconds = 2\nlisten = "0.0.0.0:9091"\n'
        'servers_from_dns = "router-admin.default.svc.cluster.local:9090"\n'
    )
    settings = settings_of("--config", str(path), environ={"ROUTER_ADMIN_TOKEN": "t0k"})
    assert settings.servers == ("a:9090", "http://b:9090")
    assert settings.poll_seconds == 2.0 and settings.listen == Address("0.0.0.0", 9091)
    assert settings.servers_from_dns == Address("router-admin.default.svc.cluster.local", 9090)
    assert settings.token == "t0k"
    flagged = settings_of("--config", str(path), "--server", "c:9090", "--poll-seconds", "0.5", "--token", "x")
    assert (flagged.servers, flagged.poll_seconds, flagged.token) == (("c:9090",), 0.5, "x")


def test_a_router_config_file_may_hold_the_scaler_table(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        'listen = "127.0.0.1:8080"\n[scaler]\nservers = ["127.0.0.1:9090"]\n'
        '[[replicas]]\nid = "r0"\nmodel = "m"\nurl = "http://127.0.0.1:8000"\n'
    )
    assert load_config(path, environ={}).replicas[0].id == "r0"
    assert settings_of("--config", str(path)).servers == ("127.0.0.1:9090",)


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ('[scaler]\nservers = ["a:1"]\npoll_seconds = "often"\n', [], "scaler.poll_seconds: must be a number"),
        ('[scaler]\nservers = ["a:1"]\ntimeout_seconds = "2"\n', [], "scaler.timeout_seconds: must be a number"),
        ('[scaler]\nservers = ["a:1"]\npoll_seconds = 0\n', [], "scaler.poll_seconds: must be at least 0.05"),
        ('[scaler]\nservers = ["a:1"]\nbogus = 1\n', [], "scaler.bogus: unknown key"),
        ('[scaler]\nservers = ["ftp://a:1"]\n', [], "scaler.servers[0]: must be host:port or an http(s) URL"),
        ('[scaler]\nservers = "a:1"\n', [], "scaler.servers: must be an array"),
        ('[scaler]\nservers = ["a:1"]\nlisten = "nowhere"\n', [], "scaler.listen: must be host:port"),
        ('[scaler]\nservers_from_dns = "svc:0"\n', [], "scaler.servers_from_dns: needs the routers' admin port"),
        ("[scaler]\n", [], "servers: no router to poll"),
        ('listen = "127.0.0.1:8080"\n', [], "no [scaler] table"),
        ("[scaler\n", [], "invalid TOML"),
        ('[scaler]\nservers = ["a:1"]\n', ["--poll-seconds", "x"], "command line: --poll-seconds: must be a number"),
        ('[scaler]\nservers = ["a:1"]\n', ["--timeout-seconds", "2s"], "command line: --timeout-seconds: must be a"),
        ('[scaler]\nservers = ["a:1"]\n', ["--poll-seconds", "nan"], "command line: --poll-seconds: must be at least"),
        ('[scaler]\nservers = ["a:1"]\n', ["--http-listen", "9091"], "--http-listen: must be host:port"),
        ('[scaler]\nservers = ["a:1"]\n', ["--http-listen", "127.0.0.1:9091"], "http_listen: must differ from listen"),
        ('[scaler]\nservers = ["a:1"]\n', ["--log-level", "loud"], "command line: --log-level: must be one of"),
    ],
)
def test_a_mistake_is_one_line_naming_the_key(text: str, argv: list[str], message: str, tmp_path: Path) -> None:
    path = tmp_path / "scaler.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        settings_of("--config", str(path), *argv)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_command_exits_2_on_a_mistake_and_says_why() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router", "scaler", "--poll-seconds", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("router scaler: command line: servers: no router to poll"), result.stderr


def test_a_port_in_use_exits_1_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "router", "scaler", "--server", "127.0.0.1:1", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1, result.stderr
    assert f"router scaler: cannot listen: 127.0.0.1:{port} (gRPC)" in result.stderr


def test_no_view_is_active_and_says_why() -> None:
    decision = decide(None, parse_metadata({"model": "m"}))
    assert decision.active and decision.reason == "no poll round has finished yet"


def test_the_docs_list_every_scaler_key_with_its_default_and_help() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    section = readme.split("## Scale to zero on Kubernetes", 1)[1]
    block = section.split("```toml\n[scaler]\n", 1)[1].split("```", 1)[0]
    documented = tomllib.loads(block)
    defaults = ScalerSettings()
    assert set(documented) == set(HELP) == {f.name for f in fields(ScalerSettings)}
    shown = apply(defaults, documented, "docs/kubernetes.md")
    assert shown == defaults
    comments = dict(re.findall(r"^(\w+) = .*?# (.*)$", block, re.M))
    assert comments == HELP
