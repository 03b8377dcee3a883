"""Statistics and int8 quantization on the GPU during a load, against a plain load and the reference.

bench_gpu.py's checkpoint and children (a fresh process per sample, modes interleaved, the first round
untimed: Numba's CUDA cache warm), shard by shard with the page cache warm: ``reference`` (safetensors'
``get_tensor`` per key), ``plain`` (``engine.stream(f, device=...)``), ``stats`` (``stats=True``), ``int8``
(``quantize="int8"``) and ``int8+stats``; ``x_plain`` and ``x_reference`` are the ratios the project
tracks.  The device-kernel rows also check a few tensors against the CPU kernels.

    python scripts/bench_gpu_kernels.py --json kernels.json                       # 16 GB, 5 samples per mode
    python scripts/bench_gpu_kernels.py --device cpu --size 16MB --repeat 1 --only plain stats   # dry run
"""

from __future__ import annotations

import sys

import harness

# isort: split
import bench_gpu

MODES = {"reference": "reference safe_open(f, device) get_tensor per key", "plain": "engine stream(f) per shard",
         "stats": "engine stream(f) stats=True per shard", "int8": "engine stream(f) quantize=int8 per shard",
         "int8+stats": "engine stream(f) stats=True quantize=int8 per shard"}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--size", default="16.06GB", help="checkpoint size (bench_gpu.py's)")
    ap.add_argument("--dir", default=bench_gpu.DIR, help="where the checkpoint is made (and reused)")
    ap.add_argument("--repeat", type=int, default=5, help="samples per mode")
    ap.add_argument("--only", nargs="+", choices=list(MODES))
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the dry run")
    a = ap.parse_args(argv)
    files = bench_gpu.checkpoint(a.dir, harness.parse_size(a.size))[0]
    bench_gpu.warm(files)

    def sample(mode: str) -> dict:
        got = bench_gpu.sample(MODES[mode], files, a.device, 600)
        if "error" in got or got.get("cpu_kernels", {}).get("mismatched"):
            raise RuntimeError(f"{mode}: {got.get('error') or got['cpu_kernels']}")
        return got

    got = harness.rounds(a.only or list(MODES), a.repeat, sample, warmup=True)
    report = harness.Report()
    for mode, samples in got.items():
        report.add(f"checkpoint -> {a.device}, warm cache", "reference" if mode == "reference" else f"engine, {mode}",
                   [s["seconds"] for s in samples], samples[0]["bytes"],
                   device_peak_bytes=max(s.get("device_peak_bytes") or 0 for s in samples) or None)
    report.against("x_plain", "engine, plain")
    report.against("x_reference", "reference")
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_plain", "x_reference", "device_peak_bytes",
                         size=a.size, device=a.device, repeat=a.repeat, device_name=harness.call(bench_gpu.where)["name"])


if __name__ == "__main__":
    sys.exit(main())
