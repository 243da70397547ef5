"""The config file: every mistake is one line naming file, key and problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.core.config.checks import Where
from router.core.config.settings import load_config, parse_config
from router.core.errors import ConfigError

GOOD = """
listen = "127.0.0.1:8080"
admin_listen = "127.0.0.1:9090"
tick_seconds = 0.5

[[replicas]]
id = "llama-0"
model = "llama-3.1-8b"
url = "http://10.0.0.5:8000/"
labels = { node = "gpu-a1", gpu_class = "h100", gpus = 1 }

[[replicas]]
id = "big-0"
model = "llama-3.1-70b"
url = "https://10.0.0.6:8000"

[models."llama-3.1-8b"]
aliases = ["llama", "default"]
fallbacks = ["llama-3.1-70b"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def test_good_config_loads_into_frozen_dataclasses(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={})
    assert config.tick_seconds == 0.5
    assert [r.id for r in config.replicas] == ["llama-0", "big-0"]
    assert config.replicas[0].url == "http://10.0.0.5:8000"
    assert config.replicas[0].labels["gpus"] == 1
    assert config.models["llama-3.1-8b"].aliases == ("llama", "default")
    with pytest.raises(AttributeError):
        config.tick_seconds = 1  # type: ignore[misc]


def test_admin_token_falls_back_to_the_environment(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={"ROUTER_ADMIN_TOKEN": "s3cret"})
    assert config.admin_token == "s3cret"


@pytest.mark.parametrize(
    ("change", "key", "problem"),
    [
        ("bogus = 1\n", "bogus", "unknown key"),
        ('[[replicas]]\nid = "llama-0"\nmodel = "x"\nurl = "http://h:1"\n', "replicas[2].id", "duplicate replica id"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "10.0.0.7:8000"\n', "replicas[2].url", "http:// or https://"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "ftp://h"\n', "replicas[2].url", "http:// or https://"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://u:p@h"\n', "replicas[2].url", "credentials"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nport = 3\n', "replicas[2].port", "unknown key"),
        ('[[replicas]]\nid = "r"\nurl = "http://h:1"\n', "replicas[2].model", "is required"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1/v1"\n', "replicas[2].url", "ends in /v1"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1/openai/v1/"\n', "replicas[2].url", "without it"),
        (
            '[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nlabels = { gpus = "two" }\n',
            "replicas[2].labels.gpus",
            "must be a positive integer",
        ),
        (
            '[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nlabels = { gpus = 0 }\n',
            "replicas[2].labels.gpus",
            "positive integer",
        ),
        (
            '[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nlabels = { gpu_class = 3 }\n',
            "replicas[2].labels.gpu_class",
            "non-empty string",
        ),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nnode = ""\n', "replicas[2].node", "not be empty"),
        ('[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nfabric = 3\n', "replicas[2].fabric", "a string"),
        (
            '[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nfabrc = "ib"\n',
            "replicas[2].fabrc",
            "did you mean 'fabric'?",
        ),
        ('[models."x"]\nfallbacks = ["nobody"]\n', 'models."x".fallbacks[0]', "no replica serves"),
        ('[models."x"]\naliases = ["llama-3.1-70b"]\n', 'models."x".aliases[0]', "shadows the model"),
        ('[models."x"]\naliases = ["llama"]\n', 'models."x".aliases[0]', "already an alias"),
        ('[models."x"]\ncolour = "red"\n', 'models."x".colour', "unknown key"),
    ],
)
def test_each_mistake_names_file_key_and_problem(tmp_path: Path, change: str, key: str, problem: str) -> None:
    # Top-level keys must come before the tables in TOML.
    text = change + GOOD if not change.startswith("[") else GOOD + change
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert problem in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("line", "key", "problem"),
    [
        ('tick_seconds = "5"', "tick_seconds", "must be a number"),
        ("tick_seconds = 0", "tick_seconds", "at least"),
        ("max_body_bytes = 1.5", "max_body_bytes", "integer"),
        ("max_attempts = true", "max_attempts", "must be an integer"),
        ('listen = "localhost"', "listen", "host:port"),
        ('listen = "127.0.0.1:99999"', "listen", "port must be"),
        ('api_keys = "k"', "api_keys", "array of strings"),
        ('usage_push_url = "collector:80"', "usage_push_url", "http://"),
        ('admin_listen = "127.0.0.1:8080"', "admin_listen", "must differ from listen .127.0.0.1:8080."),
        ('admin_listen = "0.0.0.0:8080"', "admin_listen", "must differ from listen"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, line: str, key: str, problem: str) -> None:
    name = line.split(" =", maxsplit=1)[0]
    rest = "\n".join(x for x in GOOD.splitlines() if not x.startswith(name + " ="))
    path = write(tmp_path, line + "\n" + rest)
    with pytest.raises(ConfigError, match=rf"^{path}: {key}: .*{problem}"):
        load_config(path, environ={})


def test_invalid_toml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "listen = \n"), environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml", environ={})


def test_serve_reports_a_bad_config_in_one_line_with_status_2(tmp_path: Path) -> None:
    path = write(tmp_path, "colour = 'red'\n" + GOOD)
    result = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == f"router: {path}: colour: unknown key"


def test_the_configuration_reference_says_what_the_code_declares() -> None:
    """Every setting in docs/configuration.md with its default and its help line; nothing else there."""
    import re
    import tomllib
    from pathlib import Path

    from router.core.config.settings import Address, settings

    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = readme.split("## Configuration", 1)[1]
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    documented = tomllib.loads(block)
    declared = settings()
    assert set(documented) - {"replicas", "models", "discovery", "priority_classes", "tracing"} == set(declared)
    comments = {
        m.group(1): (m.group(2) or "").strip()
        for m in re.finditer(r"^(\w+) = [^#\n]*?(?:# (.*))?$", block.split("[[replicas]]")[0], re.M)
    }
    for key, (default, setting) in declared.items():
        if setting.fallback is None or default:
            shown = documented[key]
            expected = str(default) if isinstance(default, Address) else default
            assert shown == (list(expected) if isinstance(expected, tuple) else expected), key
        assert (comments.get(key) or "") == setting.help, key
    # The tables' keys too.
    from router.core.config.models import _MODEL_KEYS
    from router.core.config.upstream import UPSTREAM_KEYS

    # The two ways to name an engine's key are exclusive, so the example shows one per table.
    replica_upstream = set().union(*documented["replicas"]) & UPSTREAM_KEYS
    assert set(documented["models"]["llama-3.1-8b"]) | replica_upstream == _MODEL_KEYS | UPSTREAM_KEYS
    from router.core.config.settings import _KUBERNETES_KEYS

    assert set(documented["discovery"]["kubernetes"]) == _KUBERNETES_KEYS
    from dataclasses import fields

    from router.core.config.tracing import TRACING_KEYS, TracingConfig

    assert set(documented["tracing"]) == TRACING_KEYS
    defaults = {f.name: f.default for f in fields(TracingConfig)}
    for key in TRACING_KEYS - {"endpoint", "headers"}:
        assert documented["tracing"][key] == defaults[key], key
    # The classes shown are the ones the router has when none is declared, every key shown.
    from router.core.config.tenants import (
        _CLASS_KEYS,
        _KEY_KEYS,
        DEFAULT_CLASSES,
        parse_api_keys,
        parse_priority_classes,
    )

    shown = documented["priority_classes"]
    assert set().union(*shown) == _CLASS_KEYS
    assert parse_priority_classes(Where("README"), shown, 5.0) == DEFAULT_CLASSES
    # And the table form of api_keys, in the block after it.
    tables = tomllib.loads(section.split("```toml\n", 2)[2].split("```", 1)[0])
    assert set().union(*tables["api_keys"].values()) | {"key"} == _KEY_KEYS
    (example,) = parse_api_keys(Where("README"), "api_keys", tables["api_keys"])
    assert (example.tenant, example.priority, example.weight) == ("search", "interactive", 2.0)
    # ... and [limits] beside it, every key shown.
    from router.core.config.limits import LIMITS_KEYS

    assert set(tables["limits"]) == LIMITS_KEYS


def test_an_unknown_routing_policy_is_refused_with_the_known_ones() -> None:
    known = r"\(known: 'least_loaded', 'session', 'prefix'\)"
    with pytest.raises(ConfigError, match=r'models\."m"\.routing: unknown policy .nearest. ' + known):
        parse_config({"models": {"m": {"routing": "nearest"}}}, "<test>", environ={})


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("session_header", "X Session", "'X Session' is not a valid header name"),
        ("session_header", "", "must not be empty|non-empty"),
        ("prefix_chars", 0, "at least 1"),
        ("prefix_chars", 10.5, "integer"),
        ("balance_factor", 0.9, "at least 1"),
        ("balance_factor", "high", "a number"),
        ("prefix_replicas", -1, "at least 0"),
        ("prefix_replicas", 1.5, "integer"),
    ],
)
def test_affinity_settings_are_checked(key: str, value: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf'models\."m"\.{key}: .*({problem})'):
        parse_config({"models": {"m": {"routing": "session", key: value}}}, "<test>", environ={})


def test_prefix_replicas_need_session_or_prefix_routing() -> None:
    needs = r'models\."m"\.prefix_replicas: spreads a prefix over replicas: '
    needs += r'it needs routing = "session" or "prefix", not \'least_loaded\''
    with pytest.raises(ConfigError, match=needs):
        parse_config({"models": {"m": {"prefix_replicas": 2}}}, "<test>", environ={})
    for routing in ("session", "prefix"):
        model = parse_config({"models": {"m": {"routing": routing, "prefix_replicas": 2}}}, "<test>", environ={})
        assert model.models["m"].prefix_replicas == 2


def test_prefix_placement_is_ring_or_learned_and_needs_prefix_routing() -> None:
    with pytest.raises(ConfigError, match=r'models\."m"\.prefix_placement: \'hash\' is not "ring" or "learned"'):
        parse_config({"models": {"m": {"routing": "prefix", "prefix_placement": "hash"}}}, "<test>", environ={})
    needs = r'models\."m"\.prefix_placement: places a prompt prefix: it needs routing = "prefix", not \'session\''
    with pytest.raises(ConfigError, match=needs):
        parse_config({"models": {"m": {"routing": "session", "prefix_placement": "learned"}}}, "<test>", environ={})
    model = parse_config({"models": {"m": {"routing": "prefix", "prefix_placement": "learned"}}}, "<test>", environ={})
    assert model.models["m"].prefix_placement == "learned"
    assert parse_config({"models": {"m": {}}}, "<test>", environ={}).models["m"].prefix_placement == "ring"


def test_affinity_settings_are_read() -> None:
    model_table = {"routing": "prefix", "prefix_chars": 2048, "balance_factor": 1.5, "session_header": "X-Chat"}
    config = parse_config({"models": {"m": model_table}}, "<test>", environ={})
    model = config.models["m"]
    assert (model.routing, model.prefix_chars, model.balance_factor, model.session_header) == (
        "prefix",
        2048,
        1.5,
        "X-Chat",
    )
    assert config.expose_replica_header is False
    assert parse_config({"expose_replica_header": True}, "<test>", environ={}).expose_replica_header is True
    with pytest.raises(ConfigError, match="expose_replica_header: must be true or false, got a string"):
        parse_config({"expose_replica_header": "yes"}, "<test>", environ={})


def test_the_routings_the_settings_accept_are_the_pools_policies() -> None:
    """The settings name the policies they accept, so as not to depend on the pool that reads them."""
    from router.core.config.models import ROUTINGS
    from router.core.pool.picking import POLICIES

    assert set(ROUTINGS) == set(POLICIES)


def test_a_replicas_node_and_fabric_are_read_and_unset_is_unknown(tmp_path: Path) -> None:
    text = GOOD + '[[replicas]]\nid = "r"\nmodel = "x"\nurl = "http://h:1"\nnode = "gpu-a1"\nfabric = "ib-east"\n'
    config = load_config(write(tmp_path, text), environ={})
    by_id = {r.id: r for r in config.replicas}
    assert (by_id["r"].node, by_id["r"].fabric) == ("gpu-a1", "ib-east")
    assert by_id["r"].as_json()["node"] == "gpu-a1"
    assert (by_id["llama-0"].node, by_id["llama-0"].fabric) == (None, None)
    assert "node" not in by_id["llama-0"].as_json()


def test_fabric_label_needs_pods_mode_and_says_so(tmp_path: Path) -> None:
    text = '[discovery.kubernetes]\nselector = "a=b"\nport = "http"\nfabric_label = "router.llm/fabric"\n'
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.fabric_label: .*needs selector_on = \"pods\""):
        load_config(path, environ={})
    config = load_config(write(tmp_path, text + 'selector_on = "pods"\n'), environ={})
    assert config.discovery is not None and config.discovery.fabric_label == "router.llm/fabric"
