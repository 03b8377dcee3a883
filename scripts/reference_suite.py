#!/usr/bin/env python
"""Run the reference's own Python test suite against the engine, and against the reference.

Copies ``bindings/python/tests`` of a huggingface/safetensors checkout (the 0.8 line) twice, rewrites
the imports of one to the engine's, runs pytest on both and prints the tests that pass on the
reference but not on the engine (flax, tensorflow, paddle and mlx modules left out).

    python scripts/reference_suite.py /path/to/safetensors [--keep] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SKIPPED_MODULES = ("test_flax_comparison.py", "test_tf_comparison.py", "test_paddle_comparison.py",
                   "test_mlx_comparison.py")

REWRITES = [
    (re.compile(r"\bfrom safetensors\.torch import"), "from engine.torch import"),
    (re.compile(r"\bfrom safetensors\.numpy import"), "from engine.numpy import"),
    (re.compile(r"\bfrom safetensors import"), "from engine import"),
    (re.compile(r"^import safetensors\.torch$", re.M), "import engine.torch"),
    (re.compile(r"^import safetensors$", re.M), "import engine as safetensors"),
    (re.compile(r"\bsafetensors\.torch\."), "engine.torch."),
]


def prepare(src_tests: str, dest: str, engine: bool) -> None:
    # the suite writes to ./tests/data relative to the directory it runs in
    tests = os.path.join(dest, "tests")
    shutil.copytree(src_tests, tests, ignore=shutil.ignore_patterns(*SKIPPED_MODULES))
    for name in os.listdir(tests) if engine else []:
        if name.endswith(".py"):
            with open(os.path.join(tests, name)) as f:
                text = f.read()
            for pattern, repl in REWRITES:
                text = pattern.sub(repl, text)
            with open(os.path.join(tests, name), "w") as f:
                f.write(text)


def run(dest: str, extra: list[str]) -> dict[str, str]:
    report = os.path.join(dest, "report.xml")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "tests", *extra], cwd=dest)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                          else "passed")
    return outcomes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="a checkout of huggingface/safetensors")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args(argv)
    src = os.path.join(args.checkout, "bindings", "python", "tests")
    if not os.path.isdir(src):
        print(f"no bindings/python/tests under {args.checkout}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="reference-suite-")
    results = {}
    try:
        for label, engine in (("reference", False), ("engine", True)):
            dest = os.path.join(root, label)
            prepare(src, dest, engine)
            results[label] = run(dest, args.pytest_args)
    finally:
        if args.keep:
            print(f"copies kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    for label, outcomes in results.items():
        counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{label}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    lost = sorted(n for n, v in results["reference"].items() if v == "passed" and results["engine"].get(n) != "passed")
    print(f"passing on the reference but not on the engine: {len(lost)}")
    for name in lost:
        print(f"  {name}: {results['engine'].get(name, 'missing')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
