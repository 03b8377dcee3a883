"""``engine bench``: load throughput of a checkpoint by each entry point (the engine's and,
when installed, the reference's), medians over repeated runs, lazy loads timed with a read
of every page."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from ._cli_output import fmt_bytes, one_line, progress, table
from .errors import SafetensorError

__all__ = ["cmd_bench"]


def _median_time(fn, runs: int, bar) -> float:
    import statistics

    fn()  # warm-up: page cache, imports, first-touch allocations
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        bar.update(1)
    return statistics.median(times)


_PAGE = 4096


def _touch(tensors: Mapping[str, Any]) -> int:
    """Read one byte of every page of every tensor, so that a lazy load is timed with its
    reads (a mapping alone reads nothing: bytes over its time would be no throughput at all).
    Returns the sum, so the reads cannot be skipped."""
    total = 0
    for t in tensors.values():
        flat = t.reshape(-1)
        raw = flat.view(_uint8_of(flat))
        if len(raw):
            total += int(raw[::_PAGE].sum()) + int(raw[-1])
    return total


def _uint8_of(flat):
    if type(flat).__module__.partition(".")[0] == "torch":
        import torch

        return torch.uint8
    import numpy as np

    return np.uint8


def cmd_bench(args) -> int:
    """``engine bench PATH``: the engine's loads (mmap, pread, CUDA) beside the reference's, median of ``--runs``."""
    from .checkpoint import open_checkpoint, read_checkpoint_info

    info = read_checkpoint_info(args.path)
    nbytes = info.nbytes
    if info.index:
        base = os.path.dirname(info.index)
    elif os.path.isdir(args.path):
        base = args.path
    else:
        base = os.path.dirname(args.path)
    files = [os.path.join(base or ".", s) for s in info.shards]
    framework = args.framework
    if framework is None:
        try:
            import torch  # noqa: F401

            framework = "pt"
        except ImportError:
            framework = "np"
    # (label, kind, load): a ratio compares only loads of one kind, mapped (timed with a
    # read of every page, see _touch) or owned memory
    cases: list[tuple[str, str, Any]] = []

    def engine_load(backend: str, device: str = "cpu"):
        def run():
            with open_checkpoint(args.path, framework=framework, device=device, backend=backend) as c:
                out = c.get_tensors()
            if device != "cpu":
                torch.cuda.synchronize()
            elif backend == "mmap":
                _touch(out)
            return out

        return run

    cases.append(("engine mmap", "lazy", engine_load("mmap")))
    cases.append(("engine pread", "owned", engine_load("pread")))
    cuda = False
    if framework == "pt":
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            cases.append(("engine pread -> cuda", "cuda", engine_load("pread", "cuda")))
    if not args.no_reference:
        try:
            ref = importlib.import_module("safetensors.torch" if framework == "pt" else "safetensors.numpy")
        except ImportError:
            print("note: the reference safetensors is not installed; no comparison", file=sys.stderr)
        else:

            def ref_load(device: str = "cpu"):
                def run():
                    out = {}
                    for f in files:
                        out.update(ref.load_file(f, device=device) if framework == "pt" else ref.load_file(f))
                    if device != "cpu":
                        torch.cuda.synchronize()
                    elif framework == "pt":  # a mapping, as the engine's "mmap" row
                        _touch(out)
                    return out

                return run

            # the reference's torch loader maps the file (lazy); its numpy loader copies (owned)
            cases.append(("reference safetensors", "lazy" if framework == "pt" else "owned", ref_load()))
            if cuda:
                cases.append(("reference safetensors -> cuda", "cuda", ref_load("cuda")))
    results: dict[str, float | Exception] = {}
    with progress(total=len(cases) * args.runs, desc="bench") as bar:
        for label, _, fn in cases:
            try:
                results[label] = _median_time(fn, args.runs, bar)
            except SafetensorError:
                raise
            except Exception as exc:  # e.g. the reference cannot load a dtype: report, go on
                results[label] = exc
    reference = {kind: results[label] for label, kind, _ in cases if label.startswith("reference")}
    print(f"{args.path}: {len(info)} tensors, {fmt_bytes(nbytes)} in {len(info.shards)} file(s), "
          f"framework={framework}, median of {args.runs} runs, warm page cache")
    rows = []
    for label, kind, _ in cases:
        t = results[label]
        what = {"lazy": "mapped, every page touched", "owned": "owned (every byte read)", "cuda": "on the GPU"}[kind]
        if isinstance(t, Exception):
            rows.append([label, what, "-", "-", f"failed: {one_line(t)[:60]}"])
            continue
        ref_t = reference.get(kind)
        ratio = f"{ref_t / t:.2f}x" if isinstance(ref_t, float) and t > 0 else "-"
        rows.append([label, what, f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.2f}" if t > 0 else "inf", ratio])
    for line in table(rows, ["load", "kind", "median ms", "GB/s", "vs reference (same kind)"], right=(2, 3, 4)):
        print(line)
    return 0
