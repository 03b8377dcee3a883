#!/usr/bin/env python
"""Where the first open's time goes: every module the engine imports on the way to its first
``safe_open`` and first tensor, with what each costs itself (``load`` and ``exec``, children excluded),
and the total against the reference's; a bare fresh interpreter per sample, torch imported first
(untimed; ``--framework np``: not); ``--open-only``: the first open and every dtype and shape, no tensor.

``--starts``: whole processes instead, each timed from outside (start to exit) beside ``python -c pass``:
``import engine`` and ``import safetensors``, ``python -m engine --help``, and ``python -m engine inspect
FILE`` beside a script that prints the same file's names, dtypes and shapes with the reference (which has
no command line); ``beyond_pass_s`` is a row's median less the bare interpreter's.

    python scripts/import_costs.py --runs 31 --framework np --json out.json
    python scripts/import_costs.py --runs 31 --open-only
    python scripts/import_costs.py --runs 31 --starts
"""

from __future__ import annotations

import subprocess
import sys
import time

import bench_core
import harness
from benchmarks import common

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

#: the reference's nearest to ``engine inspect FILE``: every name, dtype and shape, printed
REFERENCE_INSPECT = ("import sys, safetensors\n"
                     "with safetensors.safe_open(sys.argv[1], framework='np') as f:\n"
                     "    for k in f.keys():\n"
                     "        s = f.get_slice(k)\n"
                     "        print(k, s.get_dtype(), s.get_shape())\n")


def starts(path: str) -> dict[tuple[str, str], list[str]]:
    """(case, impl) -> the interpreter's arguments of each whole-process row."""
    return {("python -c pass", "limit: bare interpreter"): ["-c", "pass"],
            ("import", "engine"): ["-c", "import engine"],
            ("import", "reference"): ["-c", "import safetensors"],
            ("command line --help", "engine"): ["-m", "engine", "--help"],
            ("inspect a 291-tensor file", "engine"): ["-m", "engine", "inspect", path],
            ("inspect a 291-tensor file", "reference"): ["-c", REFERENCE_INSPECT, path]}


def _process_seconds(args: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main_starts(a, path: str) -> int:
    rows = starts(path)
    env = harness.child_env()
    got = harness.rounds(rows, a.runs, lambda key: _process_seconds(rows[key], env), warmup=True)
    report = harness.Report()
    for (case, impl), samples in got.items():
        report.add(case, impl, samples)
    bare = report.seconds("python -c pass")
    for r in report.rows:
        r["beyond_pass_s"] = r["median_s"] - bare if bare is not None and r["median_s"] is not None else None
    report.against("x_reference", "reference")
    return report.finish(a.json, "case", "impl", "median_s", "beyond_pass_s", "x_reference")


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=15)
    ap.add_argument("--framework", default="pt", choices=["pt", "np"])
    ap.add_argument("--path", help="the file to open (default: a 291-tensor demo-sized one)")
    ap.add_argument("--open-only", action="store_true", help="no first tensor: the open, every dtype and shape")
    ap.add_argument("--starts", action="store_true", help="whole processes: import, --help and inspect")
    a = ap.parse_args(argv)
    common.compile_engine()
    path = a.path or common.small_model_file(32)
    if a.starts:
        return main_starts(a, path)
    setup = common.TORCH_SETUP if a.framework == "pt" else ""
    code = {impl: (CHILD if impl == "engine" else bench_core.FIRST_OPEN).format(setup=setup, body=common.first_open_code(
        impl, path, first_tensor=not a.open_only, framework=a.framework)) for impl in ("engine", "reference")}
    # interleaved, so that drift hits both alike; hooks off for the reference, on for the engine (a little slower)
    got = harness.rounds(code, a.runs, lambda impl: harness.run_code(code[impl]))
    samples = got["engine"]
    report = harness.Report()
    case = f"import + first open{'' if a.open_only else ' + first tensor'}, framework={a.framework!r}"
    for impl, runs in got.items():
        report.add(case, impl, [s["seconds"] for s in runs])
    names = list(dict.fromkeys(n for s in samples for n in s["modules"] if n.startswith("engine")))
    for n in names:
        load = harness.median(s["modules"].get(n, (0.0, 0.0))[0] for s in samples)
        ex = harness.median(s["modules"].get(n, (0.0, 0.0))[1] for s in samples)
        report.add(f"{case}: module {n}", "engine", load + ex, load_s=load, exec_s=ex)
    modules = sum(r["median_s"] for r in report.rows[2:])
    report.note(f"{len(names)} engine modules: {modules * 1e3:.2f} ms of the engine's "
                f"{report.rows[0]['median_s'] * 1e3:.2f} ms (the rest: the open, the key loop, the tensor)")
    return report.finish(a.json, "case", "impl", "median_s", "load_s", "exec_s")


if __name__ == "__main__":
    sys.exit(main())
