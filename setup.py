"""The compiled build: the modules every request runs through, compiled ahead of time by mypyc.

Everything else about the package is in pyproject.toml; this file exists for
the one thing a declarative build cannot say: which modules become C
extensions, and what happens when they cannot be built.

- `pip install .` (or a wheel built with `python -m build`) compiles them
  where mypyc, a C compiler and Python's headers are present: about 40% fewer
  instructions per request (docs/performance.md).
- Where the compiler or Python's headers are missing, the build says so and
  installs the same modules as Python: a slower router, never a failed install.
- `ROUTER_COMPILE=0` asks for the pure build. The development venv
  (scripts/setup-venv) is pure, so that an edited module is what runs; `make
  test` also runs the suite against a compiled copy (scripts/compiled).

The modules compiled are every module of the packages one request's parse,
pick, forward and answer run through (REQUEST_PATH), a new one included, but
for a short list that says why each is left pure (EXCLUDED); per-tick and
start-up code (the usage tick, the admin API) gains nothing from compiling
and is outside those packages. tests/test_build.py holds the request path to
this: a module it imports from outside them must be one the test names as
pure, with its reason.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

# The packages one request's parse, pick, forward and answer run through:
# every module in them is compiled (a new one too), but for EXCLUDED.
REQUEST_PATH = ("router/http", "router/gateway", "router/core/pool", "router/core/limits", "router/core/clock.py")
# Each with why: what mypyc refuses, or what compiling would break or not pay for.
EXCLUDED = {
    # An error class deriving from ConnectionResetError, a builtin mypyc cannot extend.
    "router/http/writer.py": "mypyc cannot extend the builtin ConnectionResetError",
    # A `continue` inside `try/finally`, which mypyc refuses.
    "router/gateway/tunnel.py": "mypyc refuses a continue inside try/finally",
}


def compiled_sources() -> list[str]:
    """The module files to compile: every module of REQUEST_PATH (`__init__.py`, a package's
    marker run once, aside), but for EXCLUDED."""
    sources: list[str] = []
    for entry in REQUEST_PATH:
        path = ROOT / entry
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        sources += [str(p.relative_to(ROOT)) for p in found if p.name != "__init__.py"]
    return [source for source in sources if source not in EXCLUDED]


def wanted() -> bool:
    return os.environ.get("ROUTER_COMPILE", "1").strip().lower() not in ("0", "no", "false", "off")


def say(message: str) -> None:
    print(f"router build: {message}", file=sys.stderr)


class BuildOrFallBack(build_ext):
    """Build the compiled modules, or leave the package pure when no compiler can."""

    failed = False

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any failure to compile leaves a working pure install
            self._fall_back(exc)

    def build_extension(self, ext: Any) -> None:
        # All or nothing: a module's extension without the shared runtime that
        # mypyc builds beside it would not import.
        if self.failed:
            return
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - as above, per extension
            self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        if not self.failed:
            say(f"cannot compile ({exc}); installing the pure-Python modules, which run slower")
        self.failed = True
        # What was built before the failure goes too: the modules stay Python,
        # every one of them.
        for output in self.get_outputs():
            Path(output).unlink(missing_ok=True)
        if self.inplace:
            for ext in self.extensions:
                (ROOT / self.get_ext_filename(self.get_ext_fullname(ext.name))).unlink(missing_ok=True)


def compiler_present() -> bool:
    """A C compiler to call and Python's headers to compile against: without either, mypyc's work is wasted."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(compiler) is not None and headers.exists()


def extensions() -> list[Any]:
    if not wanted():
        say("ROUTER_COMPILE=0: the pure-Python build")
        return []
    if not compiler_present():
        say("no C compiler or no Python.h here; installing the pure-Python modules, which run slower")
        return []
    try:
        # Optional: without mypyc the build is pure.
        from mypyc.build import mypycify  # noqa: PLC0415
    except ImportError:
        say("mypyc is not installed; installing the pure-Python modules")
        return []
    try:
        modules: list[Any] = mypycify(compiled_sources(), opt_level="3", debug_level="0")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - mypyc's own failures exit
        say(f"mypyc cannot compile the modules ({exc!r}); installing the pure-Python modules")
        return []
    return modules


# Run by setuptools (as __main__); imported by scripts/compiled and the tests for the list alone.
if __name__ == "__main__":
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildOrFallBack})
