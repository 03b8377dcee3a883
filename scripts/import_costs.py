#!/usr/bin/env python
"""Where the first open's time goes: every module the engine imports on the way to its first
``safe_open`` (and first tensor), with what each costs itself, children excluded.

Each sample is a fresh interpreter that imports torch first (untimed, as the processes that
use ``framework="pt"`` have it), then hooks the import system and runs the first-open code of
``scripts/bench_core.py`` (``import engine``, ``safe_open(f, "pt")``, every dtype and shape,
one ``get_tensor``).  Per module it prints the median over ``--runs`` samples of

* ``load``: finding and reading the compiled file, unmarshalling it (``.py`` modules), or
  loading the shared object (``dlopen`` and the module object, extensions);
* ``exec``: running the module's body (for an extension, its native module init), less the
  modules it imports in turn (but with the import system's work of finding them);

and the total of the timed code, with the reference's total beside it.  What is left of the
total after the modules is the open itself, the key loop and the tensor.  The engine's
bytecode is compiled first (``python -m compileall engine``), as an install has it.

    python scripts/import_costs.py                 # the demo-sized 291-tensor file, 15 runs
    python scripts/import_costs.py --runs 31 --framework np
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(REPO, "asv_benchmarks")]
from benchmarks import common  # noqa: E402

CHILD = r'''
import sys, time, json
{setup}import importlib._bootstrap_external as be
stack, rec = [], {{}}

def timed(kind, name, call):
    t0 = time.perf_counter()
    stack.append(0.0)
    try:
        return call()
    finally:
        children = stack.pop()
        total = time.perf_counter() - t0
        load, ex = rec.get(name, (0.0, 0.0))
        rec[name] = (load + (total - children if kind == "load" else 0.0),
                     ex + (total - children if kind == "exec" else 0.0))
        if stack:
            stack[-1] += total

src_exec = be._LoaderBasics.exec_module
get_code = be.SourceLoader.get_code

def exec_source(self, module):
    name = module.__name__
    code = timed("load", name, lambda: get_code(self, name))
    timed("exec", name, lambda: exec(code, module.__dict__))

ext_create, ext_exec = be.ExtensionFileLoader.create_module, be.ExtensionFileLoader.exec_module
be._LoaderBasics.exec_module = exec_source
be.ExtensionFileLoader.create_module = lambda self, spec: timed("load", spec.name, lambda: ext_create(self, spec))
be.ExtensionFileLoader.exec_module = lambda self, module: timed("exec", module.__name__, lambda: ext_exec(self, module))
t0 = time.perf_counter()
{body}seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({{"seconds": seconds, "modules": rec}}))
'''

PLAIN = """{setup}import time
t0 = time.perf_counter()
{body}print("RESULT %r" % (time.perf_counter() - t0))
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError((done.stderr or done.stdout).strip()[-2000:])
    return line[7:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--framework", default="pt", choices=["pt", "np"])
    ap.add_argument("--path", default=None, help="the file to open (default: the 291-tensor demo-sized one)")
    a = ap.parse_args()
    common.compile_engine()
    path = a.path or common.small_model_file(32)
    setup = common.TORCH_SETUP if a.framework == "pt" else ""
    body = common.first_open_code("engine", path, first_tensor=True, framework=a.framework)
    ref_body = common.first_open_code("reference", path, first_tensor=True, framework=a.framework)
    samples, ref = [], []
    for _ in range(a.runs):  # interleaved, so that drift hits both alike
        samples.append(json.loads(run(CHILD.format(setup=setup, body=body))))
        ref.append(float(run(PLAIN.format(setup=setup, body=ref_body))))
    names = list(dict.fromkeys(n for s in samples for n in s["modules"] if n.startswith("engine")))
    med = statistics.median
    total_load = total_exec = 0.0
    print(f"first open with framework={a.framework!r}, {a.runs} fresh processes, medians in ms")
    print("| module | load | exec | sum |\n|---|---|---|---|")
    for n in names:
        load = med(s["modules"].get(n, (0.0, 0.0))[0] for s in samples) * 1e3
        ex = med(s["modules"].get(n, (0.0, 0.0))[1] for s in samples) * 1e3
        total_load += load
        total_exec += ex
        print(f"| {n} | {load:.2f} | {ex:.2f} | {load + ex:.2f} |")
    print(f"| {len(names)} modules | {total_load:.2f} | {total_exec:.2f} | {total_load + total_exec:.2f} |")
    total = med(s["seconds"] for s in samples) * 1e3
    print(f"engine total {total:.2f} ms (the modules {total_load + total_exec:.2f}, the rest "
          f"{total - total_load - total_exec:.2f}); reference total {med(ref) * 1e3:.2f} ms "
          "(hooks off for the reference; on for the engine, which they slow a little)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
