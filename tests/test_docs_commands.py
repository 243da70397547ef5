"""Every shell block in the README and docs/ is run, here or by the test it names, so that none can rot.

A block's fence says which (the words after `sh`, which Markdown renderers ignore):

- ```` ```sh run ````: run here, in order with the file's other such blocks, by
  bash with `set -euo pipefail`, in a copy of the clone, with its own HOME and
  a PATH that has the system's directories and the user's (~/.local/bin, the
  venv docs/install.md makes). The ports the docs use (8080, 9090, 8000) are
  swapped for free ones. `needs=TOOL` skips the block, saying so, where TOOL is
  not installed (CI installs it).
- ```` ```sh usage ````: a synopsis; each `router ...` line's command is run with
  `--help` (and `router --version` as it is), so that none names a command or
  an option the router no longer has.
- ```` ```sh tested-by=PATH[,PATH] ````: run by those tests (or that script,
  for what needs root, a cluster or an image), which must exist and name a
  command of the block.
- ```` ```sh by-hand ````: what no test may run (load benchmarks, which take
  the machine for minutes); the block says so.

Offline (unless ROUTER_TEST_FROM_INDEX=1, as in CI), pip is told to use no
index and install no dependencies, and the installed router borrows the dev
venv's through PYTHONPATH, as in tests/run/test_install.py; pipx's blocks,
which need every dependency's metadata, run only from the index.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_INDEX = os.environ.get("ROUTER_TEST_FROM_INDEX") == "1"
KINDS = ("run", "usage", "tested-by", "by-hand")
# The ports the walkthroughs use, after a colon or a space: swapped for free ones when run.
PORTS = re.compile(r"(?<=[: ])(8080|9090|8000)\b")


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int
    marks: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def mark(self, name: str) -> str | None:
        """The mark's value (`name=value`), "" for a bare mark, None without it."""
        for mark in self.marks:
            key, _, value = mark.partition("=")
            if key == name:
                return value
        return None


def shell_blocks(path: Path) -> list[Block]:
    """The ```sh blocks of a Markdown file, with the words after `sh` on their fence.

    A fence may be indented (a block inside a list item): its lines lose that indent."""
    blocks = []
    lines = path.read_text().splitlines()
    start: int | None = None
    indent = 0
    marks: tuple[str, ...] = ()
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        fence = line.lstrip(" ")
        if start is None:
            words = fence.removeprefix("```").split()
            if fence.startswith("```") and words[:1] == ["sh"]:
                start, indent, marks, body = number, len(line) - len(fence), tuple(words[1:]), []
        elif fence.startswith("```"):
            blocks.append(Block(path, start, marks, "\n".join(body) + "\n"))
            start = None
        else:
            body.append(line[indent:] if line[:indent].strip(" ") == "" else line)
    assert start is None, f"{path}:{start}: a block that never ends"
    return blocks


ALL = [block for path in DOCS for block in shell_blocks(path)]


def test_the_docs_have_shell_blocks_to_check() -> None:
    """The parser finds the blocks (a harness that finds none would pass whatever the docs say)."""
    assert len(ALL) >= 10
    assert any(block.mark("run") is not None for block in ALL)


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_every_shell_block_says_how_it_is_run(block: Block) -> None:
    kinds = [mark.partition("=")[0] for mark in block.marks if mark.partition("=")[0] in KINDS]
    assert len(kinds) == 1, f"{block.where}: mark the block with one of {KINDS} (```sh run, ...)"
    unknown = [m for m in block.marks if m.partition("=")[0] not in (*KINDS, "needs")]
    assert not unknown, f"{block.where}: unknown marks {unknown}"
    tested_by = block.mark("tested-by")
    if tested_by is not None:
        words = {w for w in re.findall(r"[\w./-]+", block.text) if len(w) > 3 and not w.startswith("-")}
        for name in tested_by.split(","):
            test = ROOT / name
            assert test.is_file(), f"{block.where}: {name} does not exist"
            assert any(w in test.read_text() for w in words), (
                f"{block.where}: {name} names none of the block's commands"
            )


def router_bin() -> Path:
    return Path(sys.executable).parent / "router"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark("usage") is not None], ids=lambda b: b.where)
def test_every_command_of_a_synopsis_exists(block: Block) -> None:
    commands = [line.split("#")[0].split() for line in block.text.splitlines() if line.startswith("router ")]
    assert commands, f"{block.where}: a synopsis with no router command"
    for words in commands:
        # The command's words up to its first option or argument in capitals/brackets.
        command = []
        for word in words[1:]:
            if word.startswith(("-", "[", "<")) or not re.fullmatch(r"[a-z]+", word):
                break
            command.append(word)
        if words[1] == "--version":
            done = subprocess.run([router_bin(), "--version"], capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0 and done.stdout.startswith("router "), f"{block.where}: {done}"
            continue
        args = [*command, "--help"]
        done = subprocess.run([router_bin(), *args], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"{block.where}: router {' '.join(args)}\n{done.stderr}"
        for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", " ".join(words)):
            assert option in done.stdout, f"{block.where}: router {' '.join(command)} has no {option}"


def clone_copy(into: Path) -> Path:
    """The clone's files as a fresh clone has them (tracked or new, nothing ignored): no build output, no venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def sandbox_env(home: Path, tools: Path) -> dict[str, str]:
    env = {
        "HOME": str(home),
        "LANG": "C.UTF-8",
        # The user's own bin directories first, as a shell profile puts them; then a
        # python3 that has pip (the dev venv's base), then the system's.
        "PATH": f"{home}/.local/bin:{home}/.local/share/router/bin:{tools}:/usr/local/bin:/usr/bin:/bin",
        # The pure build: these blocks test the install's steps, and compiling
        # each of their three builds would cost minutes (tests/test_build.py and
        # scripts/compiled test the compiled build).
        "ROUTER_COMPILE": "0",
    }
    if not FROM_INDEX:
        env |= {
            "PIP_NO_INDEX": "1",
            "PIP_NO_DEPS": "1",
            # pip's inverted spelling: "0" turns build isolation off (setuptools from PYTHONPATH).
            "PIP_NO_BUILD_ISOLATION": "0",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PYTHONPATH": sysconfig.get_paths()["purelib"],
        }
    return env


RUN_FILES = sorted({b.path for b in ALL if b.mark("run") is not None})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_walkthroughs_commands_run_as_written(path: Path, tmp_path: Path) -> None:
    """Each `sh run` block of the file, in order, in one sandbox: every one exits 0."""
    clone = clone_copy(tmp_path / "clone")
    home = tmp_path / "home"
    home.mkdir()
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "python3").symlink_to(sys.executable)
    env = sandbox_env(home, tools)
    ports: dict[str, str] = {}
    ran = 0
    for block in (b for b in ALL if b.path == path and b.mark("run") is not None):
        needs = block.mark("needs")
        if needs and shutil.which(needs) is None:
            if os.environ.get("CI"):
                pytest.fail(f"{block.where} needs {needs}, which CI installs")
            continue
        if needs == "pipx" and not FROM_INDEX:
            # pipx reads the metadata of every dependency of what it installs, and
            # offline they are not installed (PIP_NO_DEPS): run from the index, as CI does.
            continue
        # The walkthroughs name their ports (8080, 9090, 8000) for a reader to type: each is
        # swapped for one free a moment ago, the only way to keep the commands as written.
        script = PORTS.sub(lambda m: ports.setdefault(m.group(1), str(free_port())), block.text)
        log = tmp_path / f"block-{block.line}.log"
        with log.open("w") as out:
            # Output to a file, not a pipe: what a block leaves running would hold a pipe open.
            shell = subprocess.Popen(
                ["bash", "-c", "set -euo pipefail\n" + script],
                cwd=clone,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                shell.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
            finally:
                # Whatever the block left running (it should have stopped it) ends with it.
                try:
                    os.killpg(shell.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                shell.wait()
        printed = log.read_text()
        assert shell.returncode == 0, f"{block.where} exited {shell.returncode}:\n{script}\n---\n{printed}"
        for expected in re.findall(r"#\s*says: (.+)$", block.text, re.MULTILINE):
            # `A | B`: what one build prints or another's (router --version: compiled or pure Python).
            said = [PORTS.sub(lambda m: ports[m.group(1)], one.strip()) for one in expected.split(" | ")]
            assert any(one in printed for one in said), f"{block.where}: none of {said!r} in\n{printed}"
        ran += 1
    assert ran, f"{path}: every block skipped"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings."""
    found, code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_docs_reaches_a_file_and_a_heading(path: Path) -> None:
    """What moved between the README and docs/ is still where the links say."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        assert linked.exists(), f"{path.relative_to(ROOT)}: {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{path.relative_to(ROOT)}: {target}: no such heading"


def test_the_readmes_configuration_examples_are_each_a_valid_config() -> None:
    """The README's TOML blocks are whole configs a router would start with, not fragments that drifted."""
    from router.core.config.settings import parse_config

    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        parse_config(tomllib.loads(block), "README.md", environ={})
