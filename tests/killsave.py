"""Kill a save with SIGKILL at random moments, for the crash tests of the writers.

``kill_during(code, seconds, rng)`` runs ``code`` in a fresh interpreter, waits until it
prints ``ready`` (imports done, tensors built), sleeps a random part of ``seconds`` and
kills it; returns True when the kill landed before the child had finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

_PRELUDE = """
import os, sys
import numpy as np
import engine
from engine.base import _atomic
if os.environ.get("ENGINE_TEST_SCHEME") == "named":
    _atomic._linker = lambda directory: None
"""


def kill_during(code: str, seconds: float, rng, *, scheme: str = "unnamed", env: dict | None = None) -> bool:
    script = _PRELUDE + textwrap.dedent(code)
    environ = {**os.environ, "ENGINE_TEST_SCHEME": scheme, **(env or {})}
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ, text=True
    )
    try:
        line = child.stdout.readline()
        if line.strip() != "ready":
            child.kill()
            _, err = child.communicate(timeout=60)
            raise AssertionError(f"the child did not start: {line!r} {err}")
        time.sleep(float(rng.uniform(0, seconds)))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        return child.returncode == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
