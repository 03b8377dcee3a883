"""The seeded fault campaign against the engine's one HTTP client, as long as you like.

Loads a small checkpoint through every entry point from tests/rangeserver.py misbehaving at random
(tests/fault_campaign.py), fault rates rising from ``--low`` to ``--high``.  Exit status 1 when a run
gave up on a transient fault, hung, returned wrong bytes, raised outside the engine's errors, or left
a file descriptor open.  CI runs 32 runs (tests/test_remote_faults.py).

    python scripts/fault_campaign.py --runs 160 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's engine, and the test servers

import fault_campaign  # noqa: E402
from rangeserver import serving  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=160)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--low", type=float, default=0.05, help="the first run's fault rate")
    ap.add_argument("--high", type=float, default=0.30, help="the last run's fault rate")
    ap.add_argument("--permanent", type=float, default=0.01, help="the rate of permanent faults")
    ap.add_argument("--quiet", action="store_true", help="no line per run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="engine-faults-") as root:
        tensors = fault_campaign.make_checkpoint(root)
        with serving(root) as server:
            server.bulk()
            got = fault_campaign.run(server, root, tensors, seed=args.seed, runs=args.runs,
                                     rates=(args.low, args.high), permanent=args.permanent,
                                     scratch=os.path.join(root, "scratch"),
                                     log=None if args.quiet else print)
    print(json.dumps({k: v for k, v in got.items() if k != "details"}, indent=1))
    for line in got["details"]:
        print(line)
    bad = set(got["outcomes"]) - {"exact", "permanent"}
    return 1 if bad or got["fds_left"] else 0


if __name__ == "__main__":
    sys.exit(main())
