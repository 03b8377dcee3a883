"""The ``engine`` command line (also ``python -m engine``).

Subcommands: ``demo``, ``inspect``, ``validate``, ``stats``, ``quantize``, ``convert``,
``add-checksums``, ``bench``.  Expected failures (format errors, missing files, bad arguments, unreachable
URLs) print one line on stderr and exit with status 2, never a traceback; ``validate``
exits with 1 when the checkpoint has problems.  Progress bars (tqdm, when installed) are
drawn only when stderr is a terminal; ``stats``, ``quantize`` and ``validate`` also print a
line on stderr as each file is done with ``--verbose``.

This module parses the arguments and runs the short commands; ``convert`` lives in
:mod:`engine.commands._cli_convert`, ``bench`` in :mod:`engine.commands._cli_bench`, and what every command
prints besides its results (progress, tables, byte counts) in :mod:`engine.commands._cli_output`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from engine import __version__
from engine.commands._cli_bench import cmd_bench
from engine.commands._cli_convert import check_output, cmd_convert
from engine.commands._cli_output import FileProgress, error_line, fmt_bytes, one_line, table
from engine.commands._cli_output import UsageError as _UsageError
from engine.commands._cli_output import http_headers as _http_headers
from engine.errors import (
    CheckpointIndexError,
    ChecksumError,
    HeaderError,
    MissingDependencyError,
    MissingShardError,
    NonFiniteError,
    SafetensorError,
)


def _is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").isalnum()


def _remote(args, path: str) -> dict[str, Any]:
    """The request options of the command line for ``path`` when it is a URL (resolved as
    ``engine.torch.load_file`` resolves one: a file, an index or a prefix); ``{}`` for a
    local path."""
    if not _is_url(path):
        return {}
    return {"timeout": args.timeout, "headers": _http_headers(args.header)}


def _checkpoint_info(args):
    """:class:`~engine.checkpoints.checkpoint.CheckpointInfo` of a file, directory, index or URL."""
    from engine.apps.entry_points import read_checkpoint_info

    return read_checkpoint_info(args.path, max_header_size=args.max_header_size, **_remote(args, args.path))


def _kernel_api(module: str, attr: str, command: str):
    """``module.attr`` of a module built on the Numba kernels; a clear error without Numba."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        err = MissingDependencyError.of(exc, f"engine {command} (the Numba kernels)")
        if isinstance(err, MissingDependencyError):  # the library named its own feature: name the command
            err = MissingDependencyError(err.name or "numba", err.extra, f"engine {command} (the Numba kernels)")
        raise err from None
    return getattr(mod, attr)



# --------------------------------------------------------------------------- demo


def _cmd_demo(args) -> int:
    from engine.commands.demo import run

    return run(args.dir, keep=args.keep, small=args.small)


# --------------------------------------------------------------------------- inspect


def _cmd_inspect(args) -> int:
    info = _checkpoint_info(args)
    if args.json:
        json.dump(info.to_dict(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    sharded = info.is_sharded or len(info.shards) > 1
    rows = []
    for shard, t in info.tensors():
        row = [t.name, t.dtype, str(list(t.shape)), f"{t.numel:,}", f"{t.data_offsets[0]}..{t.data_offsets[1]}"]
        if sharded:
            row.append(shard)
        rows.append(row)
    header = ["name", "dtype", "shape", "params", "bytes"] + (["shard"] if sharded else [])
    for line in table(rows, header, right=(3,)):
        print(line)
    params = info.parameters()
    total = params.pop("total")
    where = f" in {len(info.shards)} shards" if sharded else ""
    print(
        f"\n{len(rows)} tensors{where}, {total:,} parameters ("
        + ", ".join(f"{k}: {v:,}" for k, v in params.items())
        + f"), {fmt_bytes(info.nbytes)} of data"
    )
    metadata = info.metadata()
    if metadata:
        print("metadata:")
        for line in _metadata_lines(metadata):
            print(line)
    if info.is_sharded and info.index_metadata:
        print("index metadata:")
        for line in _metadata_lines(info.index_metadata):
            print(line)
    return 0


def _metadata_lines(metadata: dict[str, Any]) -> list[str]:
    """One indented ``key: value`` line per entry; a value that holds JSON (the int8 format's
    record, a config) is shown as what it says rather than as one long escaped string."""
    lines = []
    for key, value in metadata.items():
        parsed = _json_value(value)
        if key == "engine.quantization" and isinstance(parsed, dict):
            lines.append(f"  {key}: {_quantization_summary(parsed)}")
        elif isinstance(parsed, (dict, list)) and parsed:
            lines.append(f"  {key}:")
            lines += ["    " + line for line in json.dumps(parsed, indent=2, ensure_ascii=False).splitlines()]
        elif isinstance(value, int) and not isinstance(value, bool):
            lines.append(f"  {key}: {value:,}")
        else:
            lines.append(f"  {key}: {value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}")
    return lines


def _json_value(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _quantization_summary(record: dict[str, Any]) -> str:
    """The int8 format's record (``engine.apps.quantized_format``) in a line: scheme, scale
    suffix, how many tensors from which dtypes, and their axes."""
    tensors = record.get("tensors")
    if not isinstance(tensors, dict):
        return json.dumps(record, ensure_ascii=False)
    dtypes: dict[str, int] = {}
    axes: dict[str, int] = {}
    for entry in tensors.values():
        entry = entry if isinstance(entry, dict) else {}
        dtypes[str(entry.get("dtype"))] = dtypes.get(str(entry.get("dtype")), 0) + 1
        axis = entry.get("axis")
        label = "per tensor" if axis is None else f"axis {axis}"
        axes[label] = axes.get(label, 0) + 1
    return (f"{record.get('scheme', '?')}, {len(tensors)} tensors quantized (from "
            + ", ".join(f"{d}: {n}" for d, n in sorted(dtypes.items())) + "; scales "
            + ", ".join(f"{a}: {n}" for a, n in sorted(axes.items()))
            + f"; each scale in the tensor named + {record.get('scale_suffix', '.scale')!r})")


# --------------------------------------------------------------------------- validate


def _cmd_validate(args) -> int:
    from engine.checkpoints.checkpoint import check_checkpoint, read_checkpoint_info

    if not _is_url(args.path) and not os.path.exists(args.path):
        raise FileNotFoundError(2, "No such file or directory", args.path)
    config, validator = _weight_validator(args)
    if _is_url(args.path):
        try:
            info = _checkpoint_info(args)
            problems: list[SafetensorError] = []
        except (HeaderError, CheckpointIndexError, MissingShardError, ChecksumError) as err:
            # what the server holds is broken (a header that fails its own checksum too): a
            # finding (exit 1), as for a local file; a server that cannot be reached or has no
            # such file is an error (exit 2)
            info, problems = None, [err]
    else:
        problems = check_checkpoint(args.path, max_header_size=args.max_header_size)
        info = None if problems else read_checkpoint_info(args.path, max_header_size=args.max_header_size)
    for problem in problems:
        print(f"problem: {one_line(problem)}")
    if info is not None:
        for shard, header in info.headers.items():
            print(f"ok: {shard}: {len(header)} tensors, {header.file_size:,} bytes, header and data region valid")
        if info.is_sharded:
            print(f"ok: index: {len(info)} tensors in {len(info.shards)} shards, consistent with every shard")
    mismatched = 0
    if info is not None:
        mismatched = _checksum_checks(args, info)
    if problems:  # the weight checks read the tensors, which a broken file cannot give
        print("weight checks: skipped (the format problems above come first)")
        weight_ok = True
    else:
        weight_ok = _weight_checks(args, config, validator)
    if problems or not weight_ok or mismatched:
        print(f"invalid: {len(problems)} format problem(s)" + ("" if weight_ok else ", weight checks failed")
              + (f", {mismatched} checksum mismatch(es)" if mismatched else ""))
        return 1
    print("valid")
    return 0


def _checksum_checks(args, info) -> int:
    """Verify the checksums each local file records (one read of its data region); print
    what was present, verified and mismatched.  Returns the number of mismatches."""
    from engine.format import checksums

    present = sum(1 for h in info.headers.values() if checksums.has_checksums(h))
    total = len(info.headers)
    if not present:
        print(f"checksums: none recorded in {total} file(s) (engine convert --checksums, or "
              "engine.add_checksums, adds them)")
        return 0
    if _is_url(args.path):
        print(f"checksums: recorded in {present} of {total} file(s); not verified here for a URL "
              "(every load of it verifies them)")
        return 0
    verified = mismatched = 0
    for shard, header in info.headers.items():
        if not checksums.has_checksums(header):
            continue
        path = info.shard_path(shard)
        try:
            want = checksums.expected(header, path)
        except ChecksumError as err:  # a damaged header, or a malformed entry: a finding
            mismatched += 1
            print(f"problem: {one_line(err)}")
            continue
        got = checksums.file_digests(path)
        for row, name in enumerate(header.table.names):
            if got[name] == int(want[row]):
                verified += 1
            else:
                mismatched += 1
                print(f"problem: {one_line(checksums.mismatch(path, name, int(want[row]), got[name]))}")
    print(f"checksums: recorded in {present} of {total} file(s); {verified} tensor(s) verified, "
          f"{mismatched} mismatched")
    return mismatched


def _weight_validator(args) -> tuple[str | None, Any]:
    """(config path, WeightValidator) for --config or a config.json beside a local
    checkpoint; (None, None) when there is none.  Made before any check runs, so that a bad
    config or a missing extra is one error line and nothing else."""
    if args.no_config:
        return None, None
    config = args.config
    if config is None and not _is_url(args.path):
        folder = args.path if os.path.isdir(args.path) else os.path.dirname(os.path.abspath(args.path))
        candidate = os.path.join(folder, "config.json")
        config = candidate if os.path.exists(candidate) else None
    if config is None:
        return config, None
    try:
        from engine.apps.validator import WeightValidator, shape_checks_skipped

        parsed = _read_config(config)
        skipped = shape_checks_skipped(parsed) if parsed is not None else None
        if skipped is not None:
            return config, skipped
        return config, WeightValidator(config)
    except MissingDependencyError as err:
        raise MissingDependencyError(
            err.name or "numba", err.extra,
            f"engine validate's weight checks against {config} (the Numba kernels)",
        ) from None


def _read_config(config: str) -> dict | None:
    """The config's JSON object, or None where it cannot be read (WeightValidator then
    names the problem)."""
    try:
        with open(config, encoding="utf-8") as f:
            parsed = json.load(f)
    except (OSError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _weight_checks(args, config: str | None, validator: Any) -> bool:
    """Run the weight validator; True when it passes, or when there is nothing to check
    against (format checks only)."""
    if args.no_config:
        print("shape checks: skipped (--no-config)")
        return True
    if config is None or validator is None:
        beside = "" if _is_url(args.path) else " and no config.json beside the checkpoint"
        print(f"weight checks: skipped (no --config{beside})")
        return True
    if isinstance(validator, str):  # an architecture the shape checks do not know
        print(f"shape checks: skipped ({config}: {validator}); the format, region and checksum checks ran")
        return True
    with FileProgress("validate", _checkpoint_info(args), args.verbose) as progress:
        report = validator.validate(args.path, progress=progress, **_remote(args, args.path))
    print(f"weight checks against {config}:")
    print(report)
    return report.ok



def _cmd_add_checksums(args) -> int:
    from engine.format.checksums import add_checksums

    files = []
    for path in args.paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not found:
                from engine.errors import SafetensorError

                raise SafetensorError("the directory holds no safetensors file", reason="NoCheckpoint", path=path)
            files += found
        elif os.path.exists(path):
            files.append(path)
        else:
            raise FileNotFoundError(2, "No such file or directory", path)
    for path in files:
        n = add_checksums(path)
        print(f"{path}: a CRC-32C for each of {n} tensors")
    return 0


# --------------------------------------------------------------------------- stats, quantize


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _cmd_stats(args) -> int:
    import dataclasses  # here, not at the top: `engine inspect` starts without it (and inspect)

    stats_file = _kernel_api("engine.apps.checkpoint_stats", "stats_file", "stats")
    with FileProgress("stats", _checkpoint_info(args), args.verbose, args.names) as progress:
        result = stats_file(args.path, names=args.names, progress=progress, max_header_size=args.max_header_size,
                            **_remote(args, args.path))
    if args.json:
        json.dump({k: dataclasses.asdict(v) for k, v in result.items()}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    if result:
        fields = [f.name for f in dataclasses.fields(next(iter(result.values())))]
        rows = [[name] + [_cell(getattr(s, f)) for f in fields] for name, s in result.items()]
        for line in table(rows, ["name", *fields], right=range(1, len(fields) + 1)):
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
    check_output(args.dst, args.src)  # a URL or a missing folder: said before the kernels load
    quantize_file = _kernel_api("engine.apps.quantized_format", "quantize_file", "quantize")
    args.path = args.src
    try:
        with FileProgress("quantize", _checkpoint_info(args), args.verbose) as progress:
            summary = quantize_file(args.src, args.dst, axis=args.axis, include=args.include, exclude=args.exclude,
                                    on_nonfinite="clamp" if args.clamp else "raise", progress=progress,
                                    max_header_size=args.max_header_size, **_remote(args, args.src))
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


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    commands: dict[str, _Parser]  # the top parser's: each command's own

    def error(self, message: str) -> NoReturn:
        # one line, not argparse's usage block, tagged as every other error line is
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help) [Usage]\n")


#: what a positional argument that names a checkpoint takes
_CHECKPOINT = ("a .safetensors file, a *.safetensors.index.json, a directory, or a URL of any of them "
               "(http(s)://, s3://, fsspec; a prefix ending in / holds an index or model.safetensors)")


def _add_remote_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_positive_float, default=30.0, help="seconds per HTTP request (URLs only)")
    p.add_argument("-H", "--header", action="append", metavar="'NAME: VALUE'",
                   help="extra HTTP request header, e.g. 'Authorization: Bearer hf_...' (repeatable)")
    p.add_argument("--max-header-size", type=int, default=100_000_000, help="largest header accepted, in bytes")


def build_parser() -> _Parser:
    parser = _Parser(prog="engine", description="Read, check, convert and write safetensors checkpoints.")
    parser.add_argument("--version", action="version", version=f"engine (safetensors-engine) {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices

    p = sub.add_parser("demo", help="write, inspect, load and verify a generated GPT-2-sized checkpoint")
    p.add_argument("--dir", help="where to write gpt2.safetensors, which stays there (default: a temporary "
                                 "directory, removed after unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory and its checkpoint")
    p.add_argument("--small", action="store_true", help="a tiny model instead of GPT-2 small (for smoke tests)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("inspect", help="table of the tensors of a file, directory, index or URL")
    p.add_argument("path", help=_CHECKPOINT)
    p.add_argument("--json", action="store_true", help="print the parsed header(s) as JSON")
    _add_remote_options(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "validate",
        help="check the format of every shard and the index, the checksums files record, and the shapes "
             "against config.json for the LLaMA family (exit 1 on problems)",
        description="Always: the header and data region of every file, the index against the shards, and "
                    "the CRC-32C of every tensor of a file that records them (engine.format.checksums; present, "
                    "verified and mismatched are printed).  Then, against a config.json (--config, or one "
                    "beside a local checkpoint), the shape and weight checks for the architectures the "
                    "validator knows (llama, mistral, qwen2, bitnet); for others (GPT-2, BERT, T5 ...) they "
                    "are reported as skipped, with the reason.")
    p.add_argument("path", help=_CHECKPOINT)
    p.add_argument("--config", help="model config.json for the weight checks (engine.apps.validator; default: a "
                                    "config.json beside a local checkpoint; needs the 'kernels' extra)")
    p.add_argument("--no-config", action="store_true",
                   help="skip the shape and weight checks against a config.json (format, region and checksum "
                        "checks still run)")
    _add_remote_options(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("stats", help="statistics of every tensor (min, max, mean, std, NaN/Inf counts)")
    p.add_argument("path", help=_CHECKPOINT)
    p.add_argument("--names", nargs="+", metavar="NAME", help="only these tensors (default: every tensor)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON, by tensor name")
    _add_remote_options(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("quantize", help="write an int8-quantized copy of a checkpoint")
    p.add_argument("src", help=_CHECKPOINT)
    p.add_argument("dst", help="the .safetensors file to write (one local file, written atomically)")
    p.add_argument("--axis", type=_axis, default=0,
                   help="channel axis of the scales: 0 (default) one per row, 'none' one per tensor")
    p.add_argument("--include", nargs="+", metavar="GLOB",
                   help="names to quantize (default: every F32/F16/BF16 tensor of 2+ dimensions)")
    p.add_argument("--exclude", nargs="+", metavar="GLOB", help="names never to quantize, e.g. 'lm_head.*'")
    p.add_argument("--clamp", action="store_true",
                   help="quantize NaN to 0 and +-Inf to +-127 and list the tensors, instead of failing")
    _add_remote_options(p)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a line on stderr as each file is done (a progress bar is drawn on a terminal anyway)")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("convert", help="PyTorch .bin/.pt state dict to .safetensors (never unpickles code)")
    p.add_argument("src", help="a local file written by torch.save (.bin, .pt, .pth)")
    p.add_argument("dst", help="the local .safetensors file to write")
    p.add_argument("--checksums", action="store_true",
                   help="record each tensor's CRC-32C in the header (engine.format.checksums); loads verify them")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("add-checksums",
                       help="record each tensor's CRC-32C in existing .safetensors files (rewritten atomically)",
                       description="Every load by the engine then verifies each tensor against its CRC-32C "
                                   "(verify_checksums=False skips it); the reference safetensors reads the "
                                   "files unchanged.  A file is rewritten as a new file renamed over the old "
                                   "one: a rewrite that is stopped leaves the old file.")
    p.add_argument("paths", nargs="+", help="files, or directories whose *.safetensors files are all rewritten")
    p.set_defaults(func=_cmd_add_checksums)

    p = sub.add_parser("bench", help="load throughput of engine backends against the reference safetensors")
    p.add_argument("path", help=_CHECKPOINT + "; a URL is timed as the engine's load over the network")
    p.add_argument("--runs", type=_positive_int, default=5, help="timed runs per case (median reported)")
    p.add_argument("--framework", choices=["np", "pt"], help="numpy or torch tensors (default: pt when torch is "
                                                             "installed)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference safetensors")
    _add_remote_options(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


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
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to, as its own errors are
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        # a warning is one line too, not Python's two with the source line
        print(f"engine {args.command}: warning: {one_line(Warning(message))} [{category.__name__}]",
              file=sys.stderr)

    shown, warnings.showwarning = warnings.showwarning, show
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
        print(f"engine {args.command}: error: {error_line(err)}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = shown
