"""The two builds: what runs is the build asked for, and a machine without a compiler still gets a router.

setup.py compiles the modules every request runs through (mypyc); `make test`
runs the suite on the pure development install (ROUTER_EXPECT_COMPILED=0) and
again on a compiled copy (scripts/compiled, ROUTER_EXPECT_COMPILED=1). Each
run checks here that it tests the build it says it tests, in this process and
in the `router` processes the other tests start.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


def setup_module_of(root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("router_setup", root / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_names() -> list[str]:
    sources: list[str] = setup_module_of(ROOT).compiled_sources()
    return [source.removesuffix(".py").replace("/", ".") for source in sources]


def test_the_compiled_list_names_the_hot_path_and_only_existing_modules() -> None:
    names = module_names()
    for hot in (
        "router.http.server.reader",
        "router.http.client.reader",
        "router.gateway.forward",
        "router.core.pool.pool",
    ):
        assert hot in names
    for name in names:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


# What the compiled modules import from outside the compiled packages, left pure on purpose.
PURE_ON_PURPOSE = {
    # The settings, tenants, engines' paths and model cards: read at start and on SIGHUP, their values
    # (frozen dataclasses) only read per request.
    "router.core.config.settings": "read at start",
    "router.core.config.tenants": "read at start",
    "router.core.config.engines": "read at start",
    "router.core.config.models": "read at start",
    "router.core.config.cards": "read when a replica joins",
    "router.core.config.limits": "read at start",
    # Compiled, mypyc takes the errors' class-level status and code, overridden per subclass,
    # for per-instance defaults, and an error was answered without them; raising one is not per-request work.
    "router.core.errors": "compiled, its class attributes lose their overrides",
    "router.http.writer": "setup.py EXCLUDED",
    "router.gateway.tunnel": "setup.py EXCLUDED",
}


def test_every_module_the_request_path_imports_is_compiled_or_pure_on_purpose() -> None:
    """A module added to the request path is compiled (setup.py derives the list from its packages),
    and one imported from outside them is a choice this test names, not an accident."""
    setup = setup_module_of(ROOT)
    compiled = set(module_names())
    graph = grimp.build_graph("router", exclude_type_checking_imports=True)
    packages = {m for m in graph.modules if (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
    outside = {
        imported
        for name in compiled
        for imported in graph.find_modules_directly_imported_by(name)
        if imported.startswith("router.") and imported not in compiled and imported not in packages
    }
    assert outside == set(PURE_ON_PURPOSE), sorted(outside ^ set(PURE_ON_PURPOSE))
    for source, why in setup.EXCLUDED.items():
        assert (ROOT / source).is_file() and why, source
        assert PURE_ON_PURPOSE.get(source.removesuffix(".py").replace("/", ".")) == "setup.py EXCLUDED"


def test_no_compiled_function_binds_one_name_to_two_kinds_of_error() -> None:
    """`except A as exc` then `except B as exc` in one function: compiled, the name keeps A's type,
    and catching a B raises TypeError instead of handling it (a refused connect answered 500)."""
    shared = []
    for source in setup_module_of(ROOT).compiled_sources():
        tree = ast.parse((ROOT / source).read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            kinds: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    kinds.setdefault(node.name, set()).add(ast.unparse(node.type) if node.type else "BaseException")
            shared += [f"{source}:{function.lineno} {name}: {sorted(k)}" for name, k in kinds.items() if len(k) > 1]
    assert not shared


@pytest.mark.skipif("ROUTER_EXPECT_COMPILED" not in os.environ, reason="make test says which build it runs")
def test_the_build_that_runs_is_the_build_asked_for() -> None:
    compiled = os.environ["ROUTER_EXPECT_COMPILED"] == "1"
    suffix = ".so" if compiled else ".py"
    here = {name: importlib.import_module(name).__file__ or "" for name in module_names()}
    assert all(path.endswith(suffix) for path in here.values()), here
    # The histograms pick their bucket search, and a stream's end its usage read, by the build they find themselves in.
    assert importlib.import_module("router.gateway.metrics").COMPILED is compiled
    assert importlib.import_module("router.gateway.tokens").BYTEWISE is compiled
    # The processes the tests start (router serve, workers) import the same build.
    started = subprocess.run(
        [sys.executable, "-c", "import router.http.server.reader as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        timeout=60,
    )
    assert started.stdout.strip().endswith(suffix)
    # And `router --version` says so, as an operator asks an installed router.
    said = subprocess.run(
        [sys.executable, "-m", "router", "--version"], capture_output=True, text=True, check=True, cwd="/", timeout=60
    )
    assert said.stdout.strip().endswith("(compiled)" if compiled else "(pure Python)"), said.stdout


@pytest.mark.timeout(600)
def test_a_machine_without_a_compiler_gets_the_pure_modules(tmp_path: Path) -> None:
    """The compiler fails (CC=false): the build says why, succeeds, and leaves no compiled module behind."""
    pytest.importorskip("mypyc")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "router", tree / "router", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        check=False,
        cwd=tree,
        env={**os.environ, "CC": "false", "ROUTER_COMPILE": "1"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "installing the pure-Python modules" in done.stderr
    assert not list(tree.rglob("*.so"))
    served = subprocess.run(
        [sys.executable, "-c", "import router.http.server.reader as m; print(m.__file__)"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert served.stdout.strip() == str(tree / "router" / "http" / "server" / "reader.py")


def test_every_editable_install_into_the_dev_venv_asks_for_the_pure_build() -> None:
    """An editable install compiles the tree in place unless told not to, and then an edited module is not what runs.

    `make bench` once did: after it the development venv ran .so files beside the sources,
    and `make test`'s pure run failed `test_the_build_that_runs_is_the_build_asked_for`.
    """
    places = [ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    places += [p for p in sorted((ROOT / "scripts").iterdir()) if p.is_file()]
    unpure = [
        f"{place.relative_to(ROOT)}: {line.strip()}"
        for place in places
        for line in place.read_text().splitlines()
        if "pip install" in line and " -e " in f"{line} " and "ROUTER_COMPILE=0" not in line
    ]
    assert unpure == []
