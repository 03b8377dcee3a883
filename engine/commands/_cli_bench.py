"""``engine bench``: load throughput of a checkpoint by each entry point (the engine's and,
when installed, the reference's), medians over repeated runs, lazy loads timed with a read
of every page."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Mapping
from typing import Any

from engine.commands._cli_output import fmt_bytes, http_headers, one_line, progress, table
from engine.errors import SafetensorError

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


#: what each kind of row measures: rows are compared only within one kind
KINDS = {
    "owned": "owned memory: every byte read into tensors the process owns",
    "lazy": "mapped (lazy): every page faulted in, one byte of each 4 KiB page read",
    "cuda": "on the GPU: every byte copied to the device",
    "network": "over the network: every byte received into owned tensors",
}


def cmd_bench(args) -> int:
    """``engine bench PATH``: the engine's loads (mmap, pread, CUDA) beside the reference's, median of ``--runs``."""
    from engine.apps.entry_points import read_checkpoint_info
    from engine.base._files import is_url
    from engine.checkpoints.checkpoint import open_checkpoint

    remote = is_url(args.path)
    options = {"timeout": args.timeout, "headers": http_headers(args.header)} if remote else {}
    info = read_checkpoint_info(args.path, max_header_size=args.max_header_size, **options)
    files = [] if remote else [info.shard_path(s) for s in info.shards]
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

    if remote:
        from engine.urls.remote_load import load

        cases.append(("engine", "network", lambda: load(args.path, framework=framework, **options)))
        if not args.no_reference:
            print("note: the reference safetensors loads local files only; no comparison for a URL", file=sys.stderr)
        return _report(args, info, framework, cases, "")

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
    return _report(args, info, framework, cases, ", warm page cache")


def _report(args, info, framework: str, cases: list[tuple[str, str, Any]], note: str) -> int:
    """Time every case and print one table per kind of work (:data:`KINDS`): a mapped load
    that touches a byte per page and an owned load that reads every byte are not the same
    work, so they never share a table or a ratio."""
    nbytes = info.nbytes
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
          f"framework={framework}, median of {args.runs} runs{note}")
    for kind, what in KINDS.items():
        rows = []
        for label, k, _ in cases:
            if k != kind:
                continue
            t = results[label]
            if isinstance(t, Exception):
                rows.append([label, "-", "-", f"failed: {one_line(t)[:60]}"])
                continue
            ref_t = reference.get(kind)
            ratio = f"{ref_t / t:.2f}x" if isinstance(ref_t, float) and t > 0 else "-"
            rows.append([label, f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.2f}" if t > 0 else "inf", ratio])
        if not rows:
            continue
        print(f"\n{what}:")
        for line in table(rows, ["load", "median ms", "GB/s", "vs reference"], right=(1, 2, 3)):
            print("  " + line)
    return 0
