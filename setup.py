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

The modules are those one request's parse, pick, forward and answer run
through, measured with bench/instructions.py; per-tick and start-up code
gains nothing from compiling and is left out. Three modules mypyc refuses:
router/http/writer.py (an error class deriving from ConnectionResetError, a
builtin it cannot extend), router/gateway/tunnel.py (a `continue` inside
`try/finally`) and router/core/usage/snapshots.py (an int stored where a float is
declared). router/core/errors.py compiles, but mypyc takes its errors'
class-level `status` and `code`, overridden per subclass, for per-instance
defaults, and the suite found an error answered without them; raising an
error is not per-request work.
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

# Relative to the project root; directories stand for every module in them.
COMPILED = [
    "router/gateway/codings.py",
    "router/http/headers.py",
    "router/http/messages.py",
    "router/http/pipe.py",
    "router/http/protocol_errors.py",
    "router/http/transports.py",
    "router/http/wire.py",
    "router/http/server/",
    "router/http/client/",
    "router/gateway/access_log.py",
    "router/gateway/affinity.py",
    "router/gateway/answers.py",
    "router/gateway/bodies.py",
    "router/gateway/call.py",
    "router/gateway/catalog.py",
    "router/gateway/chain.py",
    "router/gateway/dispatch.py",
    "router/gateway/forward.py",
    "router/gateway/hold.py",
    "router/gateway/keys.py",
    "router/gateway/metrics.py",
    "router/gateway/outcomes.py",
    "router/gateway/responses.py",
    "router/core/clock.py",
    "router/core/pool/coldstart.py",
    "router/core/pool/ejection.py",
    "router/core/pool/picking.py",
    "router/core/pool/pool.py",
    "router/core/pool/replicas.py",
    "router/core/pool/ring.py",
    "router/core/pool/tallies.py",
    "router/core/pool/waiters.py",
]


def compiled_sources() -> list[str]:
    """The module files to compile, `__init__.py` excepted (a package's marker, run once)."""
    sources: list[str] = []
    for entry in COMPILED:
        path = ROOT / entry
        found = sorted(path.glob("*.py")) if entry.endswith("/") else [path]
        sources += [str(p.relative_to(ROOT)) for p in found if p.name != "__init__.py"]
    return sources


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
