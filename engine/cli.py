"""The ``engine`` command line (also ``python -m engine``).

Subcommands: ``demo``, ``inspect``, ``validate``, ``stats``, ``quantize``, ``convert``,
``bench``.  Expected failures (format errors, missing files, bad arguments, unreachable
URLs) print one line on stderr and exit with status 2, never a traceback; ``validate``
exits with 1 when the checkpoint has problems.  Progress bars (tqdm, when installed) are
drawn only when stderr is a terminal; ``stats``, ``quantize`` and ``validate`` also print a
line on stderr as each file is done with ``--verbose``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from .errors import MissingDependencyError, NonFiniteError, SafetensorError

# --------------------------------------------------------------------------- helpers


class _NoBar:
    """Stands in for a tqdm bar when stderr is not a terminal or tqdm is not installed."""

    def __init__(self, iterable: Iterable | None = None) -> None:
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable or ())

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress(iterable: Iterable | None = None, **kw: Any):
    """A tqdm bar on stderr when it is a terminal; silent (and tqdm not imported) otherwise."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return _NoBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, file=sys.stderr, leave=False, dynamic_ncols=True, **kw)


class _FileProgress:
    """Progress of a command that walks the tensors of a checkpoint, fed by the library's
    ``progress(name, nbytes)`` callback: a bar of bytes on a terminal (as :func:`_progress`)
    and, with ``--verbose``, a line on stderr as each file is done."""

    def __init__(self, command: str, path: str, verbose: bool, names: Iterable[str] | None = None) -> None:
        from .checkpoint import read_checkpoint_info

        info = read_checkpoint_info(path)
        wanted = set(names) if names is not None else None
        self._command = command
        self._verbose = verbose
        self._shard_of: dict[str, str] = {}
        self._left: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        for shard, t in info.tensors():
            if wanted is None or t.name in wanted:
                self._shard_of[t.name] = shard
                self._left[shard] = self._left.get(shard, 0) + 1
                self._bytes[shard] = self._bytes.get(shard, 0) + t.nbytes
        self._count = dict(self._left)
        self._done = 0
        self._bar = _progress(total=sum(self._bytes.values()), unit="B", unit_scale=True, desc=command)

    def __call__(self, name: str, nbytes: int) -> None:
        self._bar.update(nbytes)
        shard = self._shard_of.get(name)
        if shard is None:
            return
        self._left[shard] -= 1
        if self._left[shard] == 0 and self._verbose:
            self._done += 1
            line = (f"engine {self._command}: {self._done}/{len(self._left)} {shard}: "
                    f"{self._count[shard]} tensors, "
                    f"{_fmt_bytes(self._bytes[shard])}")
            write = getattr(self._bar, "write", None)  # tqdm's, which keeps the bar below the line
            if write is not None:
                write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> _FileProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def _is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").isalnum()


def _http_headers(values: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for value in values or ():
        name, sep, text = value.partition(":")
        if not sep or not name.strip():
            raise _UsageError(f"--header expects 'Name: value', got {value!r}")
        out[name.strip()] = text.strip()
    return out


class _UsageError(Exception):
    """A bad argument found after parsing (exit 2, one line)."""


def _checkpoint_info(args):
    """:class:`~engine.checkpoint.CheckpointInfo` of a file, directory, index or URL."""
    if _is_url(args.path):
        from .remote import read_metadata

        return read_metadata(
            args.path,
            timeout=args.timeout,
            headers=_http_headers(args.header),
            max_header_size=args.max_header_size,
        )
    from .checkpoint import read_checkpoint_info

    return read_checkpoint_info(args.path, max_header_size=args.max_header_size)


def _kernel_api(module: str, attr: str, command: str):
    """``module.attr`` of a module built on the Numba kernels; a clear error without Numba."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingDependencyError(exc.name or "numba", "kernels", f"engine {command}") from None
    return getattr(mod, attr)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def _table(rows: list[list[str]], header: list[str], right: Sequence[int] = ()) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(header)] + [line(r) for r in rows]


# --------------------------------------------------------------------------- demo


def _cmd_demo(args) -> int:
    from .demo import run

    return run(args.dir, keep=args.keep, small=args.small)


# --------------------------------------------------------------------------- inspect


def _cmd_inspect(args) -> int:
    info = _checkpoint_info(args)
    if args.json:
        json.dump(info.to_dict(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    sharded = info.is_sharded
    rows = []
    for shard, t in info.tensors():
        row = [t.name, t.dtype, str(list(t.shape)), f"{t.numel:,}", f"{t.data_offsets[0]}..{t.data_offsets[1]}"]
        if sharded:
            row.append(shard)
        rows.append(row)
    header = ["name", "dtype", "shape", "params", "bytes"] + (["shard"] if sharded else [])
    for line in _table(rows, header, right=(3,)):
        print(line)
    params = info.parameters()
    total = params.pop("total")
    where = f" in {len(info.shards)} shards" if sharded else ""
    print(
        f"\n{len(rows)} tensors{where}, {total:,} parameters ("
        + ", ".join(f"{k}: {v:,}" for k, v in params.items())
        + f"), {_fmt_bytes(info.nbytes)} of data"
    )
    metadata = info.metadata()
    if metadata:
        print("metadata: " + json.dumps(metadata, ensure_ascii=False))
    if sharded and info.index_metadata:
        print("index metadata: " + json.dumps(info.index_metadata, ensure_ascii=False, sort_keys=True))
    return 0


# --------------------------------------------------------------------------- validate


def _cmd_validate(args) -> int:
    from .checkpoint import check_checkpoint, read_checkpoint_info

    if not _is_url(args.path) and not os.path.exists(args.path):
        raise FileNotFoundError(2, "No such file or directory", args.path)
    config, validator = _weight_validator(args)
    if _is_url(args.path):
        try:
            info = _checkpoint_info(args)
            problems: list[SafetensorError] = []
        except SafetensorError as err:
            info, problems = None, [err]
    else:
        problems = check_checkpoint(args.path, max_header_size=args.max_header_size)
        info = None if problems else read_checkpoint_info(args.path, max_header_size=args.max_header_size)
    for problem in problems:
        print(f"problem: {_one_line(problem)}")
    if info is not None:
        for shard, header in info.headers.items():
            print(f"ok: {shard}: {len(header)} tensors, {header.file_size:,} bytes, header and data region valid")
        if info.is_sharded:
            print(f"ok: index: {len(info)} tensors in {len(info.shards)} shards, consistent with every shard")
    if problems:  # the weight checks read the tensors, which a broken file cannot give
        print("weight checks: skipped (the format problems above come first)")
        weight_ok = True
    else:
        weight_ok = _weight_checks(args, config, validator)
    if problems or not weight_ok:
        print(f"invalid: {len(problems)} format problem(s)" + ("" if weight_ok else ", weight checks failed"))
        return 1
    print("valid")
    return 0


def _weight_validator(args) -> tuple[str | None, Any]:
    """(config path, WeightValidator) for --config or a config.json beside the checkpoint;
    (None, None) when there is none or the checkpoint is a URL.  Made before any check runs,
    so that a bad config is one error line and nothing else."""
    config = args.config
    if config is None and not _is_url(args.path):
        folder = args.path if os.path.isdir(args.path) else os.path.dirname(os.path.abspath(args.path))
        candidate = os.path.join(folder, "config.json")
        config = candidate if os.path.exists(candidate) else None
    if config is None or _is_url(args.path):
        return config, None
    from .validator import WeightValidator

    return config, WeightValidator(config)


def _weight_checks(args, config: str | None, validator: Any) -> bool:
    """Run the weight validator; True when it passes, or when there is nothing to check
    against (format checks only)."""
    if config is None:
        print("weight checks: skipped (no --config and no config.json beside the checkpoint)")
        return True
    if validator is None:
        print("weight checks: skipped for URLs (they need the tensor bytes)")
        return True
    with _FileProgress("validate", args.path, args.verbose) as progress:
        report = validator.validate(args.path, progress=progress)
    print(f"weight checks against {config}:")
    print(report)
    return report.ok


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split("\n"))


# --------------------------------------------------------------------------- stats, quantize


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _cmd_stats(args) -> int:
    import dataclasses  # here, not at the top: `engine inspect` starts without it (and inspect)

    stats_file = _kernel_api("engine.filestats", "stats_file", "stats")
    with _FileProgress("stats", args.path, args.verbose, args.names) as progress:
        result = stats_file(args.path, names=args.names, progress=progress)
    if args.json:
        json.dump({k: dataclasses.asdict(v) for k, v in result.items()}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    if result:
        fields = [f.name for f in dataclasses.fields(next(iter(result.values())))]
        rows = [[name] + [_cell(getattr(s, f)) for f in fields] for name, s in result.items()]
        for line in _table(rows, ["name", *fields], right=range(1, len(fields) + 1)):
            print(line)
    return 0


def _axis(text: str) -> int | None:
    if text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _cmd_quantize(args) -> int:
    quantize_file = _kernel_api("engine.quantized", "quantize_file", "quantize")
    _check_output(args.dst, args.src)
    try:
        with _FileProgress("quantize", args.src, args.verbose) as progress:
            summary = quantize_file(args.src, args.dst, axis=args.axis, include=args.include, exclude=args.exclude,
                                    on_nonfinite="clamp" if args.clamp else "raise", progress=progress)
    except NonFiniteError as err:
        # the library's message names the Python argument; a shell user has the flag
        name = err.tensors[0] if err.tensors else None
        raise NonFiniteError(
            f"{f'tensor {name!r}' if name else 'a tensor'} holds {err.nan_count} NaN, {err.posinf_count} +Inf "
            f"and {err.neginf_count} -Inf values; int8 quantization needs finite values "
            "(pass --clamp to quantize NaN to 0 and +-Inf to +-127)",
            path=err.path, tensors=err.tensors, nan_count=err.nan_count, posinf_count=err.posinf_count,
            neginf_count=err.neginf_count,
        ) from None
    print(summary)
    print(f"wrote {args.dst}")
    return 0


# --------------------------------------------------------------------------- convert


def _torch():
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("torch", "torch", "engine convert") from None
    return torch


#: How the first bytes of a file tell its format: torch.save's zip archive (torch >= 1.6),
#: its legacy pickle stream (a pickle PROTO opcode) or tar archive, and a safetensors header
#: (an 8-byte length, then the JSON object).
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_LFS_POINTER = b"version https://git-lfs"


def _sniff(path: str) -> str:
    """``"zip"``, ``"pickle"`` (also tar) or ``"safetensors"``: which reader ``path`` needs.

    Decided from the first bytes, before any reader sees the file: ``torch.load`` handed a
    text file fails deep inside its unpickler with whatever exception the stray bytes
    provoke (``KeyError: 101`` for an ``e``), and hands any ``.safetensors`` path to the
    safetensors package, whose errors name no file.
    """
    from ._files import open_regular

    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory, not a checkpoint file", path)
    fd = open_regular(path)  # a FIFO would block a plain open
    try:
        head = os.pread(fd, 512, 0)
    finally:
        os.close(fd)
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head[257:262] == b"ustar":
        return "pickle"  # or the tar archive of torch < 0.4, which torch.load reads the same way
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head.startswith(_LFS_POINTER):
        what = "a Git LFS pointer, not the checkpoint (fetch the file itself, e.g. with `git lfs pull`)"
    elif not head:
        what = "an empty file"
    else:
        printable = all(32 <= b < 127 or b in b"\t\r\n" for b in head)
        what = f"{'a text file' if printable else 'not a checkpoint'} (it starts with {head[:16]!r})"
    raise SafetensorError(
        f"{what}: expected a file written by torch.save or a .safetensors file", reason="InvalidCheckpoint", path=path
    )


def _load_torch_checkpoint(path: str, torch) -> Any:
    """What the file at ``path`` holds, by the reader its format needs.

    torch.save's files go through ``torch.load(weights_only=True)`` (no code is ever
    unpickled), memory-mapped when they are zip archives; a ``.safetensors`` file goes
    through the engine's own reader.
    """
    import pickle

    kind = _sniff(path)
    if kind == "safetensors":
        from .torch import load_file

        return load_file(path)
    try:
        if kind == "zip":
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SafetensorError(
            f"refusing to load: the pickle needs more than plain tensors and containers "
            f"(torch.load(weights_only=True) said: {first})",
            reason="UnsafePickle",
            path=path,
        ) from None
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # a damaged archive or stream: torch raises whatever its reader met
        said = _one_line(exc)[:300] or type(exc).__name__
        raise SafetensorError(
            f"not a PyTorch checkpoint torch.load can read (truncated or damaged?): {type(exc).__name__}: {said}",
            reason="InvalidCheckpoint",
            path=path,
        ) from None


def _check_output(dst: str, src: str) -> None:
    """Fail before any work when ``dst`` cannot be written: name the missing directory (the
    writer, which writes a temporary file beside ``dst``, would name that file), and refuse
    to replace the input itself (the atomic writer would, losing the source weights)."""
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "the output directory does not exist", folder)
    if os.path.isdir(dst):
        raise IsADirectoryError(errno.EISDIR, "the output is a directory; give a file name", dst)
    try:
        same = os.path.samefile(src, dst)
    except OSError:  # no output yet, or no input (its own error comes next)
        same = False
    if same:
        raise FileExistsError(errno.EEXIST, "the output is the input file; write the result elsewhere", dst)


def _state_dict(obj: Any, torch, path: str) -> tuple[dict, list[str]]:
    """The flat ``name -> tensor`` mapping inside what ``torch.load`` returned."""
    if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in ("state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
                print(f"note: converting the tensors under {key!r}", file=sys.stderr)
                obj = inner
                break
    if not isinstance(obj, Mapping):
        raise SafetensorError(
            f"expected a state dict (a mapping of names to tensors), got {type(obj).__name__}",
            reason="InvalidCheckpoint",
            path=path,
        )
    tensors, skipped = {}, []
    for name, value in obj.items():
        if isinstance(name, str) and isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            skipped.append(str(name))
    if not tensors:
        raise SafetensorError("the checkpoint holds no tensors", reason="InvalidCheckpoint", path=path)
    return tensors, skipped


def _cmd_convert(args) -> int:
    torch = _torch()
    from . import writer
    from .dtypes import BY_NAME, from_torch

    _check_output(args.dst, args.src)
    obj = _load_torch_checkpoint(args.src, torch)
    tensors, skipped = _state_dict(obj, torch, args.src)
    if skipped:
        print(f"note: skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:8])}", file=sys.stderr)
    from .torch import deduplicate

    tensors, aliases, copied = deduplicate(tensors)
    metadata = {"format": "pt"}
    for dropped, kept in aliases.items():
        metadata.setdefault(dropped, kept)
    entries = []
    for name, t in tensors.items():
        code = from_torch(t.dtype)
        shape = tuple(t.shape)
        if code == BY_NAME["F4"].code and shape:  # float4_e2m1fn_x2 counts bytes, the format values
            shape = shape[:-1] + (shape[-1] * 2,)
        entries.append((name, code, shape))
    total = sum(t.nbytes for t in tensors.values())
    with writer.open_writer(args.dst, entries, metadata) as w, _progress(
        total=total, unit="B", unit_scale=True, desc="convert"
    ) as bar:
        for name, t in tensors.items():
            w.write(name, t)
            bar.update(t.nbytes)
    print(f"wrote {args.dst}: {len(tensors)} tensors, {_fmt_bytes(total)}")
    if aliases:
        print("shared tensors stored once (dropped -> kept, also in the metadata): "
              + ", ".join(f"{d} -> {k}" for d, k in aliases.items()))
    if copied:
        print(f"copied to contiguous memory: {', '.join(copied)}")
    return 0


# --------------------------------------------------------------------------- bench


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


def _cmd_bench(args) -> int:
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
    with _progress(total=len(cases) * args.runs, desc="bench") as bar:
        for label, _, fn in cases:
            try:
                results[label] = _median_time(fn, args.runs, bar)
            except SafetensorError:
                raise
            except Exception as exc:  # e.g. the reference cannot load a dtype: report, go on
                results[label] = exc
    reference = {kind: results[label] for label, kind, _ in cases if label.startswith("reference")}
    print(f"{args.path}: {len(info)} tensors, {_fmt_bytes(nbytes)} in {len(info.shards)} file(s), "
          f"framework={framework}, median of {args.runs} runs, warm page cache")
    rows = []
    for label, kind, _ in cases:
        t = results[label]
        what = {"lazy": "mapped, every page touched", "owned": "owned (every byte read)", "cuda": "on the GPU"}[kind]
        if isinstance(t, Exception):
            rows.append([label, what, "-", "-", f"failed: {_one_line(t)[:60]}"])
            continue
        ref_t = reference.get(kind)
        ratio = f"{ref_t / t:.2f}x" if isinstance(ref_t, float) and t > 0 else "-"
        rows.append([label, what, f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.2f}" if t > 0 else "inf", ratio])
    for line in _table(rows, ["load", "kind", "median ms", "GB/s", "vs reference (same kind)"], right=(2, 3, 4)):
        print(line)
    return 0


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_remote_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP request (URLs only)")
    p.add_argument("-H", "--header", action="append", metavar="'NAME: VALUE'",
                   help="extra HTTP request header, e.g. 'Authorization: Bearer hf_...' (repeatable)")
    p.add_argument("--max-header-size", type=int, default=100_000_000, help="largest header accepted, in bytes")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="engine", description="Read, check, convert and write safetensors checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="write, inspect, load and verify a generated GPT-2-sized checkpoint")
    p.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--small", action="store_true", help="a tiny model instead of GPT-2 small (for smoke tests)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("inspect", help="table of the tensors of a file, directory, index or URL")
    p.add_argument("path", help="a .safetensors file, a *.safetensors.index.json, a directory, or a URL")
    p.add_argument("--json", action="store_true", help="print the parsed header(s) as JSON")
    _add_remote_options(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("validate", help="check the format of every shard and the index (exit 1 on problems)")
    p.add_argument("path", help="a .safetensors file, a *.safetensors.index.json, a directory, or a URL")
    p.add_argument("--config", help="model config.json for the weight checks (engine.validator)")
    _add_remote_options(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("stats", help="statistics of every tensor (min, max, mean, std, NaN/Inf counts)")
    p.add_argument("path")
    p.add_argument("--names", nargs="+", metavar="NAME", help="only these tensors")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("quantize", help="write an int8-quantized copy of a checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--axis", type=_axis, default=0,
                   help="channel axis of the scales: 0 (default) one per row, 'none' one per tensor")
    p.add_argument("--include", nargs="+", metavar="GLOB",
                   help="names to quantize (default: every F32/F16/BF16 tensor of 2+ dimensions)")
    p.add_argument("--exclude", nargs="+", metavar="GLOB", help="names never to quantize, e.g. 'lm_head.*'")
    p.add_argument("--clamp", action="store_true",
                   help="quantize NaN to 0 and +-Inf to +-127 and list the tensors, instead of failing")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("convert", help="PyTorch .bin/.pt state dict to .safetensors (never unpickles code)")
    p.add_argument("src", help="a file written by torch.save")
    p.add_argument("dst", help="the .safetensors file to write")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("bench", help="load throughput of engine backends against the reference safetensors")
    p.add_argument("path", help="a .safetensors file, an index or a directory")
    p.add_argument("--runs", type=_positive_int, default=5, help="timed runs per case (median reported)")
    p.add_argument("--framework", choices=["np", "pt"], help="default: pt when torch is installed")
    p.add_argument("--no-reference", action="store_true", help="skip the reference safetensors")
    p.set_defaults(func=_cmd_bench)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 invalid checkpoint, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"engine {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `engine inspect x | head`: stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return 0
    except (SafetensorError, OSError, _UsageError) as err:
        print(f"engine {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
