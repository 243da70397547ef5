"""`scripts/setup-venv` (what `make demo` and `make test` start with) is safe to run twice at once.

Python's venv and pip are what is outside here: a stand-in interpreter makes a venv whose
pip logs each run's start and end, slowly, so that two unlocked runs would overlap.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STAND_IN_PYTHON = """#!/bin/sh
# Only what setup-venv asks of it: -m venv DIR.
[ "$1" = "-m" ] && [ "$2" = "venv" ] || exit 64
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<PIP
#!/bin/sh
echo "start \\$*" >> "$LOG"
sleep 0.3
[ -n "\\$FAIL_INSTALL" ] && [ "\\$3" = "-e" ] && exit 3
[ "\\$3" = "-e" ] && touch "$3/bin/router"
echo "end" >> "$LOG"
PIP
chmod +x "$3/bin/pip"
"""


def project(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup-venv", root / "scripts" / "setup-venv")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    return root, python, tmp_path / "pip.log"


def setups(root: Path, python: Path, log: Path, count: int = 1, **env: str) -> list[tuple[int, str]]:
    """Run `count` setups at once; each one's exit status and what it printed to stderr."""
    running = [
        subprocess.Popen(
            [sys.executable, str(root / "scripts" / "setup-venv"), str(python), ".venv", "test"],
            cwd=root,
            env={"PATH": "/usr/bin:/bin", "LOG": str(log), **env},
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    printed = [process.communicate(timeout=30)[1] for process in running]
    return [(process.returncode, text) for process, text in zip(running, printed, strict=True)]


def test_two_setups_at_once_install_once_and_never_overlap(tmp_path: Path) -> None:
    root, python, log = project(tmp_path)
    assert [status for status, _ in setups(root, python, log, count=2)] == [0, 0]
    lines = log.read_text().splitlines()
    # One run did the work (pip upgrade, then the install), start and end in turn; the other found it done.
    assert [line.split()[0] for line in lines] == ["start", "end", "start", "end"], lines
    assert lines[0].startswith("start install --quiet --upgrade pip")
    assert lines[2] == "start install --quiet -e .[test]"
    assert (root / ".venv" / "bin" / "router").exists()
    # Once current, a third run does nothing at all.
    assert setups(root, python, log) == [(0, "")]
    assert len(log.read_text().splitlines()) == 4


def test_a_failed_install_says_which_step_and_is_redone_next_time(tmp_path: Path) -> None:
    root, python, log = project(tmp_path)
    [(status, printed)] = setups(root, python, log, FAIL_INSTALL="1")
    assert status == 3
    assert "install --quiet -e .[test] failed with status 3" in printed
    assert not (root / ".venv" / "bin" / "router").exists()
    assert setups(root, python, log) == [(0, "")]
    assert (root / ".venv" / "bin" / "router").exists()
