"""The README's first command: write, inspect, load and verify a GPT-2-sized checkpoint."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

import numpy as np

GPT2_SMALL = dict(vocab=50257, positions=1024, width=768, layers=12)


def gpt2_state_dict(
    vocab: int, positions: int, width: int, layers: int, *, dtype=np.float32, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random weights with the names and shapes of a GPT-2 checkpoint."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype, copy=False)

    sd = {"wte.weight": w(vocab, width), "wpe.weight": w(positions, width)}
    for i in range(layers):
        p = f"h.{i}."
        sd[p + "ln_1.weight"] = np.ones(width, dtype)
        sd[p + "ln_1.bias"] = np.zeros(width, dtype)
        sd[p + "attn.c_attn.weight"] = w(width, 3 * width)
        sd[p + "attn.c_attn.bias"] = w(3 * width)
        sd[p + "attn.c_proj.weight"] = w(width, width)
        sd[p + "attn.c_proj.bias"] = w(width)
        sd[p + "ln_2.weight"] = np.ones(width, dtype)
        sd[p + "ln_2.bias"] = np.zeros(width, dtype)
        sd[p + "mlp.c_fc.weight"] = w(width, 4 * width)
        sd[p + "mlp.c_fc.bias"] = w(4 * width)
        sd[p + "mlp.c_proj.weight"] = w(4 * width, width)
        sd[p + "mlp.c_proj.bias"] = w(width)
    sd["ln_f.weight"] = np.ones(width, dtype)
    sd["ln_f.bias"] = np.zeros(width, dtype)
    return sd


def _digest(tensors: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(directory: str | None = None, *, keep: bool = False, small: bool = False, echo=print) -> int:
    """Run the demo; returns a process exit code (0 when every check passed).

    The checkpoint, ``gpt2.safetensors``, is written into ``directory`` and stays there; without
    one, into a temporary directory that is removed at the end unless ``keep``.  The last line
    printed names the kept file, or the directory removed.
    """
    import engine
    import engine.numpy

    shape = dict(vocab=1000, positions=64, width=64, layers=2) if small else GPT2_SMALL
    workdir = directory or tempfile.mkdtemp(prefix="engine-demo-")
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "gpt2.safetensors")
    try:
        sd, t = _timed(lambda: gpt2_state_dict(**shape))
        nbytes = sum(a.nbytes for a in sd.values())
        echo(f"generated GPT-2-shaped weights: {len(sd)} tensors, {nbytes / 1e6:.1f} MB F32 ({t:.2f} s)")

        _, t = _timed(lambda: engine.numpy.save_file(sd, path, metadata={"format": "np", "model": "gpt2-demo"}))
        echo(f"save_file   {path}: {os.path.getsize(path) / 1e6:.1f} MB in {t:.3f} s ({nbytes / t / 1e9:.2f} GB/s, atomic)")

        header, t = _timed(lambda: engine.read_header(path))
        params = header.parameters()
        echo(f"read_header {len(header)} tensors, {params.get('total', 0):,} parameters, "
             f"header {header.header_size} bytes in {t * 1e3:.2f} ms")
        for name in header.offset_keys()[:3]:
            info = header[name]
            echo(f"    {name:<24} {info.dtype:<5} {str(list(info.shape)):<14} bytes {info.data_offsets}")
        echo(f"    ... {len(header) - 3} more")

        expected = _digest(sd)
        ok = True
        for backend in ("mmap", "pread"):
            loaded, t = _timed(lambda backend=backend: engine.numpy.load_file(path, backend=backend))
            digest, t_read = _timed(lambda loaded=loaded: _digest(loaded))
            same = digest == expected and loaded.keys() == sd.keys()
            ok &= same
            echo(f"load_file   backend={backend:<5} {t:.3f} s, read every byte {t_read:.3f} s: "
                 f"{'identical' if same else 'MISMATCH'}")

        with engine.safe_open(path, framework="numpy") as f:
            block = f.get_slice("wte.weight")[:8, -16:]
            same = np.array_equal(block, sd["wte.weight"][:8, -16:])
            ok &= same
            echo(f"get_slice   wte.weight[:8, -16:] -> {block.shape}: {'identical' if same else 'MISMATCH'}")

        try:
            import safetensors.numpy as reference
        except ImportError:
            echo("reference    safetensors not installed: skipped the cross-check")
        else:
            ref, t = _timed(lambda: reference.load_file(path))
            same = _digest(ref) == expected
            ok &= same
            echo(f"reference   safetensors.numpy.load_file reads our file: {'identical' if same else 'MISMATCH'}")
        echo("demo: all checks passed" if ok else "demo: CHECKS FAILED")
        return 0 if ok else 1
    finally:
        # the last line says where the checkpoint is, or that it is gone: the README's examples
        # run on it (``engine demo --dir demo``)
        if not keep and directory is None:
            shutil.rmtree(workdir, ignore_errors=True)
            echo(f"removed {workdir}; keep the checkpoint with --dir DIR or --keep")
        elif os.path.exists(path):
            echo(f"kept {path}")
