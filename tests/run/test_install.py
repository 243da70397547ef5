"""The router installed as a user installs it: its wheel, in a fresh venv, far from the clone.

The wheel is built from the clone and installed into a new venv; `router
--version` and `router demo` then run from that venv, in a directory that is
not the clone, so that nothing the clone holds (the package's source, the dev
venv's editable install) can stand in for what the wheel carries.

Its dependencies come from the package index when ROUTER_TEST_FROM_INDEX=1
(CI, which reaches the registries). Elsewhere the test may have no network: the
wheel is installed without them, and the fresh venv borrows the dev venv's
installed dependencies through PYTHONPATH (a directory on PYTHONPATH has its
packages imported but its .pth files ignored, so the dev venv's editable
`router` does not come along: the test checks that the one imported is the
wheel's).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
FROM_INDEX = os.environ.get("ROUTER_TEST_FROM_INDEX") == "1"
# A new terminal: the system's PATH, no venv activated.
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def installed_env(home: Path) -> dict[str, str]:
    """The environment a user's shell gives the installed router (plus, offline, the borrowed dependencies)."""
    env = {"PATH": SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8"}
    if not FROM_INDEX:
        env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    return env


def build_wheel(into: Path) -> Path:
    """The clone's wheel, built with the dev venv's setuptools (no build environment to download)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            into,
            ROOT,
        ],
        check=True,
        timeout=240,
        cwd=ROOT,
        # The pure build (a py3-none-any wheel): what is tested here is the
        # install, and the compiled build is tested by scripts/compiled.
        env={**os.environ, "ROUTER_COMPILE": "0"},
    )
    [wheel] = into.glob("router-*.whl")
    return wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the clone's wheel installed, as docs/install.md does it."""
    top = tmp_path_factory.mktemp("install")
    wheel = build_wheel(top / "dist")
    assert wheel.name == f"router-{VERSION}-py3-none-any.whl"
    venv = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *([] if FROM_INDEX else ["--no-deps", "--no-index"]), wheel], check=True, timeout=300)
    yield venv
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.timeout(600)
def test_the_installed_router_says_its_version(venv: Path, tmp_path: Path) -> None:
    """`router --version` from the wheel's venv prints the version pyproject.toml gives."""
    done = subprocess.run(
        [venv / "bin" / "router", "--version"],
        env=installed_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # The walkthroughs build the pure wheel (ROUTER_COMPILE=0); the image test sees "(compiled)".
    assert done.stdout.strip() == f"router {VERSION} (pure Python)"


@pytest.mark.timeout(600)
def test_the_installed_router_is_the_wheels_not_the_clones(venv: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [venv / "bin" / "python", "-c", "import router.tools.fake, router.run.cli; print(router.__file__)"],
        env=installed_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(venv), done.stdout


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


@pytest.mark.timeout(600)
def test_the_installed_routers_demo_serves_and_its_printed_commands_work(venv: Path, tmp_path: Path) -> None:
    """The demo from the wheel starts, prints commands spelled for that venv, and they work in a new shell."""
    env = installed_env(tmp_path)
    demo = subprocess.Popen(
        [
            venv / "bin" / "router",
            "demo",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--token-delay",
            "0",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert demo.stdout is not None
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not printed or printed[-1].strip() != "Ctrl-C stops it."):
            line = demo.stdout.readline()
            assert line, "the demo ended early:\n" + "".join(printed)
            printed.append(line)
        text = "".join(printed)
        assert text.rstrip().endswith("Ctrl-C stops it."), text
        # Spelled for the venv it runs from, not for the clone's .venv.
        assert f"{venv}/bin/router ctl" in text, text
        # Port 0 for both: the printout names the ports taken.
        client, admin = (
            m.group(1) if (m := re.search(rf"^  {name} +http://([^/\s]+)/", text, re.MULTILINE)) else ""
            for name in ("clients", "admin")
        )
        status, models = _get(f"http://{client}/v1/models")
        assert status == 200 and "llama-3.1-8b" in models
        ctl = [
            line.strip().split("     #")[0]
            for line in printed
            if " ctl " in line and line.strip().startswith(str(venv)) and " drain " not in line
        ]
        assert len(ctl) >= 3, text
        for command in ctl:
            shell = subprocess.run(
                ["bash", "-c", command], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
            )
            assert shell.returncode == 0, f"{command}\n{shell.stdout}{shell.stderr}"
        replicas = subprocess.run(
            [venv / "bin" / "router", "ctl", "replicas", "--server", admin],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert re.search(r"^llama-0\s", replicas.stdout, re.MULTILINE), replicas.stdout
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        try:
            demo.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.communicate()
