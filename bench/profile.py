"""Where one request's instructions go, from the callgrind dumps `bench/instructions.py --profile DIR` keeps.

    .venv/bin/python bench/instructions.py --profile /tmp/prof [--compiled]
    .venv/bin/python bench/profile.py /tmp/prof/router-short.callgrind --requests 2000

Two tables, per request: the instructions spent in each library (the
interpreter, the event loop, the HTTP parser, JSON, libc, the compiled
modules), from callgrind's exclusive counts; and the router's own functions
by inclusive count (each with what it calls), which callgrind can name only
in the compiled build: there, each Python function is a C function
(`CPyDef_<module>___<Class>___<method>`); in the pure build all of them are
the interpreter's one bytecode loop.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# callgrind_annotate's lines: "1,234 (5.6%)  file:function [object]"
LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*?)(?:\s+\[(.+)\])?$")
# A mypyc function: CPyDef_ (native entry) or CPyPy_ (Python-callable wrapper);
# the module's dots and the class are joined by three underscores.
COMPILED = re.compile(r"CPyDef_(\w+)$")


def library(where: str, obj: str) -> str:
    """The part of the process a function belongs to, from its object file (or, inlined, its name)."""
    name = Path(obj).name if obj else ""
    function = where.rsplit(":", 1)[-1]
    if "libpython" in name or (not name and ("Python-3" in where or "/Include/" in where)):
        if function.startswith("_PyEval_EvalFrameDefault"):
            return "interpreter: the bytecode loop"
        return "interpreter: objects, calls, memory"
    for key, label in (
        ("__mypyc", "the router's compiled modules (mypyc)"),
        ("_asyncio", "asyncio's C tasks and futures"),
        ("loop.cpython", "event loop (uvloop, libuv)"),
        ("parser.cpython", "HTTP parser (httptools, llhttp)"),
        ("orjson", "JSON (orjson)"),
        ("libc.", "libc"),
    ):
        if key in name:
            return label
    if not name and function.startswith(("uv_", "uv__")):
        return "event loop (uvloop, libuv)"
    if "cpython-311" in name and "/router/" in obj:
        return "the router's compiled modules (mypyc)"
    return "other"


def readable(name: str) -> str:
    """A coroutine's C name as its Python one.

    `chain.serve_Chain_gen.__mypyc_generator_helper__` is `chain.Chain.serve`.
    """
    suffix = "_gen.__mypyc_generator_helper__"
    if not name.endswith(suffix):
        return name
    module, _, function = name.removesuffix(suffix).rpartition(".")
    method, _, owner = function.rpartition("_")
    if method and owner[:1].isupper():
        function = f"{owner}.{method}"
    return f"{module}.{function} (coroutine)" if module else f"{function} (coroutine)"


def annotate(dump: Path, inclusive: bool) -> list[tuple[int, str, str]]:
    command = ["callgrind_annotate", "--threshold=100", f"--inclusive={'yes' if inclusive else 'no'}", str(dump)]
    text = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300).stdout
    rows = []
    started = False
    for line in text.splitlines():
        if "file:function" in line:
            started = True
            continue
        match = LINE.match(line) if started else None
        if match:
            rows.append((int(match.group(1).replace(",", "")), match.group(2), match.group(3) or ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path, help="a callgrind dump kept by bench/instructions.py --profile")
    parser.add_argument("--requests", type=int, default=2000, help="the requests the dump counted")
    parser.add_argument("--top", type=int, default=25, help="functions listed")
    args = parser.parse_args()
    if not shutil.which("callgrind_annotate"):
        parser.error("callgrind_annotate is not installed (Debian's valgrind package)")
    per_library: dict[str, int] = defaultdict(int)
    total = 0
    for count, where, obj in annotate(args.dump, inclusive=False):
        per_library[library(where, obj)] += count
        total += count
    print("| where | instructions per request | share |\n| --- | --- | --- |")
    for name, count in sorted(per_library.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {count / args.requests:,.0f} | {100 * count / total:.1f}% |")
    print(f"| total | {total / args.requests:,.0f} | |")
    functions: dict[str, int] = {}
    for count, where, _ in annotate(args.dump, inclusive=True):
        match = COMPILED.search(where.split(":")[-1].split("'")[0])
        if match:
            name = readable(match.group(1).replace("___", "."))
            functions[name] = max(functions.get(name, 0), count)
    if functions:
        print("\n| router function (inclusive) | instructions per request | share |\n| --- | --- | --- |")
        ranked = sorted(functions.items(), key=lambda kv: -kv[1])[: args.top]
        for name, count in ranked:
            print(f"| `{name}` | {count / args.requests:,.0f} | {100 * count / total:.1f}% |")
    else:
        print("\n(no compiled functions in this dump: the pure build's are all the interpreter's bytecode loop)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
