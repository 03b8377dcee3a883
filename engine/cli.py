"""The ``engine`` command line (also ``python -m engine``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .errors import SafetensorError


def _cmd_demo(args) -> int:
    from .demo import run

    return run(args.dir, keep=args.keep, small=args.small)


def _cmd_inspect(args) -> int:
    from .header import read_header

    header = read_header(args.path)
    if args.json:
        json.dump(header.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    rows = [(n, header[n]) for n in header.offset_keys()]
    width = max([len(n) for n, _ in rows] + [4])
    print(f"{'name':<{width}}  {'dtype':<11} {'shape':<20} {'params':>14}  bytes")
    for name, info in rows:
        print(f"{name:<{width}}  {info.dtype:<11} {str(list(info.shape)):<20} {info.numel:>14,}  "
              f"{info.data_offsets[0]}..{info.data_offsets[1]}")
    params = header.parameters()
    total = params.pop("total", sum(params.values()))
    print(f"\n{len(rows)} tensors, {total:,} parameters ("
          + ", ".join(f"{k}: {v:,}" for k, v in params.items()) + ")")
    if header.metadata:
        print("metadata: " + json.dumps(header.metadata, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="Read, check and write safetensors files.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="write, inspect, load and verify a generated GPT-2-sized checkpoint")
    p.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--small", action="store_true", help="a tiny model instead of GPT-2 small (for smoke tests)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("inspect", help="table of the tensors of a file")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the parsed header as JSON")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SafetensorError as err:
        print(f"engine: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError) as err:
        print(f"engine: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `engine inspect x | head`
        return 0
