"""What a device load leaves behind in the process, as the CUDA driver sees it (rows of gpu_check.py).

1. no stale error: after a load ``cudaPeekAtLastError`` is clear and a torch kernel runs;
2. the current device is the same before and after a load to another GPU, on this thread and on a fresh
   one, and ``device="cuda"`` lands on the current device;
3. ``load_into`` of tensors whose ``zero_()`` is queued behind a slow kernel gives the file's bytes;
4. a process on the last GPU that loads (from its thread and ``engine.stream``'s worker) has a context on
   no other GPU (``nvidia-smi``);
5. a child forked while a ring is kept releases what it inherited and loads without hanging;
6. int8 through the torch fallback (numba's kernels set aside) in windows, inside a stream whose queue
   lags behind a slow kernel, equals the CPU kernels' output;
7. a CuPy load to the last GPU (with int8 staging) leaves a context on no other GPU (``nvidia-smi``);
8. a process with CuPy and no torch (no ``libcudart`` mapped: the driver's entry points) loads to its GPU,
   byte for byte;
9. a load inside ``torch.cuda.stream(s)`` between NCCL collectives (a group of one) lands the file's bytes;
10. a group load (``process_group=``) on an NCCL group of one, its agreements over the gloo group the
    engine derives from it, fills CUDA tensors (its rounds through device blocks, sent over NCCL) and
    returns CPU tensors (over gloo) byte for byte;
11. a loaded tensor copied on a side stream behind a slow kernel, ``record_stream``-ed and dropped with the
    rest of the load before the copy runs, then its memory asked for again and overwritten: the copy has
    the file's bytes (with ``per_tensor=False``'s one block, which the caching allocator does not own,
    the detail says whether it did not).

``--device cpu``: rows 1, 2 and 5 on the emulated CUDA runtime (tests/emucudart); the others name the
tests that check them.  ``python scripts/driver_check.py --device cuda:0 --dir DIR`` prints the rows as JSON.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

import harness

ROWS = ("driver: no stale error after a load", "driver: current device unchanged by a load",
        "driver: load_into after a queued zero_()", "driver: no context on another GPU",
        "driver: a load in a forked child", "driver: windowed int8 on the torch fallback",
        "driver: no context on another GPU after a CuPy load", "driver: a CuPy-only process",
        "driver: a load in torch.cuda.stream(s) beside NCCL", "driver: a group load on an NCCL group",
        "driver: record_stream on a loaded tensor")
#: torch.cuda._sleep's cycles ahead of the queued zero_() (about half a second on an H100)
SLEEP_CYCLES = 1_000_000_000


def _row(name: str, fn) -> dict:
    """``fn() -> (status, reason)`` as a row; an exception is a failed row."""
    t0 = time.monotonic()
    try:
        status, reason = fn()
    except Exception as exc:
        status, reason = "failed", f"{type(exc).__name__}: {exc}"[:400]
    return {"row": name, "status": status, "reason": reason, "seconds": round(time.monotonic() - t0, 2)}


def _checkpoint(folder: str, torch=None):
    """A 48 MiB file of four tensors (F32, BF16, F16, I8): its path and its tensors."""
    import numpy as np

    import engine.numpy

    rng = np.random.default_rng(7)
    arrays = {
        "f32": rng.standard_normal((1024, 4096), dtype=np.float32),
        "bf16": rng.integers(0, 1 << 16, (2048, 4096), dtype=np.uint16),
        "f16": rng.standard_normal((1024, 4100)).astype(np.float16),
        "i8": rng.integers(-128, 128, (4096, 1025), dtype=np.int8),
    }
    path = os.path.join(folder, "driver-check.safetensors")
    if torch is None:
        engine.numpy.save_file(arrays, path)
        return path, arrays
    import engine.torch

    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    tensors["bf16"] = tensors["bf16"].view(torch.bfloat16)
    engine.torch.save_file(tensors, path)
    return path, tensors


def _fork_row(load_in_parent, path: str, arrays: dict) -> tuple[str, str]:
    """A ring kept by a load here, then a fork: the child releases its inherited rings and loads
    ``path`` to numpy; it must exit 0 within 30 s."""
    import numpy as np

    import engine
    import engine.numpy

    engine.keep_staging(True)
    try:
        load_in_parent()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                from engine.gpu import rings

                rings.release_rings()
                got = engine.numpy.load_file(path)
                code = 0 if all(np.array_equal(np.asarray(got[k]).view(np.uint8),
                                               np.ascontiguousarray(v).view(np.uint8)) for k, v in arrays.items()) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                    return "ok", "the child released its inherited rings and loaded the file's bytes"
                return "failed", f"the child ended with status {status}"
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "failed", "the forked child hung (killed after 30 s)"
    finally:
        engine.keep_staging(False)


def cuda_rows(device: str, folder: str) -> list[dict]:
    import torch

    import engine
    import engine.torch
    from engine.gpu import rings
    from engine.gpu.cudart import cuda_runtime_path
    from engine.sinks import torch as torch_sink

    target = torch.device(device)
    torch.cuda.set_device(target)
    n = torch.cuda.device_count()
    path, tensors = _checkpoint(folder, torch)

    def same(got: dict) -> bool:
        return all(torch.equal(got[k].cpu().view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())

    def stale():
        rt = ctypes.CDLL(cuda_runtime_path(torch_sink._cuda_major()))
        got = engine.torch.load_file(path, device=str(target))
        err = rt.cudaPeekAtLastError()  # before anything clears it
        y = (torch.ones(1 << 20, device=target) * 2).sum().item()  # torch checks its launch
        ok = err == 0 and y == 2 << 20 and same(got)
        return ("ok" if ok else "failed"), f"cudaPeekAtLastError {err} after the load; a kernel ran: {y == 2 << 20}"

    def current():
        before = torch.cuda.current_device()
        other = n - 1
        rings.release_rings()  # the load sets its ring up on this thread
        engine.torch.load_file(path, device=f"cuda:{other}")
        after = torch.cuda.current_device()
        plain = engine.torch.load_file(path, device="cuda")
        on = {t.device.index for t in plain.values()}
        fresh: dict = {}

        def elsewhere() -> None:  # a thread that never used CUDA: its device stays its own
            fresh["before"] = torch.cuda.current_device()
            engine.torch.load_file(path, device=f"cuda:{other}")
            fresh["after"] = torch.cuda.current_device()

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        ok = before == after and on == {before} and fresh.get("before") == fresh.get("after")
        return ("ok" if ok else "failed"), (f"current device {before} before, {after} after a load to cuda:{other}"
                                            f" ({n} GPU(s)); device='cuda' landed on {sorted(on)}; a fresh thread's"
                                            f" {fresh.get('before')} before, {fresh.get('after')} after")

    def ordered():
        dst = {k: torch.empty(v.shape, dtype=v.dtype, device=target) for k, v in tensors.items()}
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # a slow kernel on the current stream
        for t in dst.values():
            t.zero_()  # queued behind it
        t0 = time.perf_counter()
        engine.load_into(path, dst)
        waited = time.perf_counter() - t0
        torch.cuda.synchronize()
        ok = same(dst)
        return ("ok" if ok else "failed"), (f"{'the file' if ok else 'NOT the file'}'s bytes after the queued zero_(); "
                                            f"load_into took {waited:.2f} s behind the slow kernel")

    def contexts():
        if n < 2:
            return "skipped", "one GPU: no other GPU to find a context on"
        code = ("import json, subprocess, os, torch, engine, engine.torch\n"
                "from engine.gpu import rings\n"
                f"torch.cuda.set_device({n - 1})\n"
                f"engine.torch.load_file({path!r}, device='cuda')\n"
                f"list(engine.stream({path!r}, framework='pt', device='cuda'))\n"
                "rings.release_rings(); torch.cuda.synchronize()\n"
                "def smi(q): return subprocess.run(['nvidia-smi', q, '--format=csv,noheader'], capture_output=True,"
                " text=True, check=True).stdout\n"
                "gpus = dict(l.split(', ') for l in smi('--query-gpu=uuid,index').split('\\n') if l)\n"
                "apps = smi('--query-compute-apps=pid,gpu_uuid')\n"
                "print('RESULT', json.dumps(sorted(int(gpus[u]) for p, u in (l.split(', ') for l in"
                " apps.split('\\n') if l) if int(p) == os.getpid())))\n")
        seen = harness.run_code(code, env=harness.child_env(), timeout=120)
        if not seen:
            return "skipped", "nvidia-smi lists no process of the child's (another PID namespace)"
        ok = seen == [n - 1]
        return ("ok" if ok else "failed"), f"a process on GPU {n - 1} has contexts on GPU(s) {seen}"

    cpu = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in tensors.items()}

    def fork():
        return _fork_row(lambda: engine.torch.load_file(path, device=str(target)), path, cpu)

    def windowed():
        import numpy as np

        from engine.loading import kernel_probe, load_hooks
        from engine.quantize import Int8

        saved = kernel_probe._KERNELS[:], kernel_probe._WARNED[:], load_hooks.STAGING_BYTES
        kernel_probe._KERNELS[:] = ["set aside by driver_check: the torch fallback"]
        kernel_probe._WARNED[:] = [True]
        load_hooks.STAGING_BYTES = 8 << 20  # a window per tensor: each window's scratch freed for the next
        names = ("f32", "bf16", "f16")
        try:
            s = torch.cuda.Stream(device=target)
            with torch.cuda.stream(s):
                torch.cuda._sleep(SLEEP_CYCLES // 2)  # the fallback's reads queue behind it
                got = dict(engine.stream(path, framework="pt", device=str(target),
                                         quantize=Int8(include=list(names), on_nonfinite="clamp")))
            torch.cuda.synchronize()
        finally:
            kernel_probe._KERNELS[:], kernel_probe._WARNED[:], load_hooks.STAGING_BYTES = saved
        wrong = []
        for name in names:
            q, scale = engine.quantize_int8(tensors[name], 0, on_nonfinite="clamp")
            q, scale = (np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in (q, scale))
            if not (np.array_equal(got[name].q.cpu().numpy(), q)
                    and np.array_equal(got[name].scale.float().cpu().numpy().view(np.uint32),
                                       scale.astype(np.float32).view(np.uint32))):
                wrong.append(name)
        return ("ok" if not wrong else "failed"), (f"{len(names)} tensors in windows of 8 MiB, the stream behind a "
                                                   f"slow kernel: {'all equal the CPU kernels' if not wrong else 'WRONG: ' + ', '.join(wrong)}")

    def cupy_code(body: str, no_torch: bool = False) -> str:
        return (("import sys; sys.modules['torch'] = None\n" if no_torch else "")
                + "import json, os, subprocess, numpy as np, cupy, engine, engine.numpy\n"
                "from engine.gpu import rings\n" + body)

    def cupy_contexts():
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "skipped", "CuPy is not installed here (tests/test_load_hooks.py checks it on the emulated runtime)"
        if n < 2:
            return "skipped", "one GPU: no other GPU to find a context on"
        last = n - 1
        code = cupy_code(
            "from engine.quantize import Int8\n"
            f"got = dict(engine.stream({path!r}, framework='cupy', device='cuda:{last}', quantize=Int8(include=['f32'])))\n"
            f"del got; rings.release_rings(); cupy.cuda.Device({last}).synchronize()\n"
            "def smi(q): return subprocess.run(['nvidia-smi', q, '--format=csv,noheader'], capture_output=True,"
            " text=True, check=True).stdout\n"
            "gpus = dict(l.split(', ') for l in smi('--query-gpu=uuid,index').split('\\n') if l)\n"
            "apps = smi('--query-compute-apps=pid,gpu_uuid')\n"
            "print('RESULT', json.dumps(sorted(int(gpus[u]) for p, u in (l.split(', ') for l in"
            " apps.split('\\n') if l) if int(p) == os.getpid())))\n")
        seen = harness.run_code(code, env=harness.child_env(), timeout=120)
        if not seen:
            return "skipped", "nvidia-smi lists no process of the child's (another PID namespace)"
        ok = seen == [n - 1]
        return ("ok" if ok else "failed"), f"a CuPy load to GPU {n - 1} left contexts on GPU(s) {seen}"

    def cupy_only():
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "skipped", "CuPy is not installed here (tests/test_cudart.py checks the runtime's lookup)"
        code = cupy_code(
            f"want = engine.numpy.load_file({path!r})\n"
            f"got = dict(engine.stream({path!r}, framework='cupy', device='cuda:0'))\n"
            "same = all(cupy.asnumpy(got[k]).tobytes() == np.ascontiguousarray(v).tobytes() for k, v in want.items())\n"
            "rings.release_rings()\n"
            "from engine.gpu import cudart\n"
            "print('RESULT', json.dumps({'same': same, 'torch': 'torch' in sys.modules and sys.modules['torch'] is not None,"
            " 'route': cudart.cuda_runtime_path()}))\n",
            no_torch=True)
        got = harness.run_code(code, env=harness.child_env(), timeout=120)
        ok = got["same"] and not got["torch"]
        return ("ok" if ok else "failed"), (f"a process without torch loaded with CuPy through {got['route']}: "
                                            f"bytes {'equal' if got['same'] else 'DIFFER'}")

    def in_nccl_group(body: str, test: str):
        """``body`` run in a fresh process that is the one rank of an NCCL group on the target
        device (``dev``; ``path``, the checkpoint): its RESULT, or why the row is skipped."""
        import socket

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return None, f"this torch has no NCCL ({test})"
        with socket.socket() as sock:  # a free port for the group's store
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        code = ("import json, os, torch, torch.distributed as dist, engine, engine.torch\n"
                f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}')\n"
                f"path = {path!r}\n"
                f"dev = torch.device({str(target)!r}); torch.cuda.set_device(dev)\n"
                "dist.init_process_group('nccl', rank=0, world_size=1, device_id=dev)\n"
                + body +
                "dist.destroy_process_group()\n"
                "print('RESULT', json.dumps(out))\n")
        return harness.run_code(code, env=harness.child_env(), timeout=150), None

    def nccl():
        got, skip = in_nccl_group(
            "x = torch.ones(1 << 20, device=dev); s = torch.cuda.Stream(device=dev)\n"
            "with torch.cuda.stream(s):\n"
            "    for _ in range(4): dist.all_reduce(x)\n"
            "    got = engine.torch.load_file(path, device=str(dev))\n"
            "    dist.all_reduce(x)\n"
            "torch.cuda.synchronize()\n"
            "want = engine.torch.load_file(path)\n"
            "same = all(torch.equal(got[k].cpu().view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())\n"
            "out = {'same': same, 'sum': float(x[0])}\n",
            "tests/test_device_ring.py checks a shared stream on the emulated runtime")
        if got is None:
            return "skipped", skip
        ok = got["same"] and got["sum"] == 1.0
        return ("ok" if ok else "failed"), (f"a load between all_reduces on a side stream: bytes "
                                            f"{'equal' if got['same'] else 'DIFFER'}; the collectives finished")

    def nccl_group():
        got, skip = in_nccl_group(
            "import engine.apps.group_load as gl\n"
            "blocks, made = [], gl._device_block\n"
            "gl._device_block = lambda n, d: (blocks.append(str(d)), made(n, d))[1]\n"
            "want = engine.torch.load_file(path)\n"
            "dest = {k: torch.empty_like(v, device=dev) for k, v in want.items()}\n"
            "names = engine.load_into(path, dest, process_group=dist.group.WORLD)\n"
            "from engine.apps.group_load import stream\n"  # tensor parallelism's broadcast mode: typed device views
            "tp = {k: v.clone() for k, v in stream(path, dist.group.WORLD, _release=True, _device=dev)}\n"
            "on_dev = dict(engine.stream(path, process_group=dist.group.WORLD, device=dev))\n"
            "on_dev_owned = engine.torch.load_file(path, process_group=dist.group.WORLD, device=str(dev))\n"
            "owned = engine.torch.load_file(path, process_group=dist.group.WORLD)\n"
            "torch.cuda.synchronize()\n"
            "out = {'same': sorted(names) == sorted(want) and all(torch.equal(dest[k].cpu().view(torch.uint8), "
            "v.view(torch.uint8)) and torch.equal(owned[k].view(torch.uint8), v.view(torch.uint8)) "
            "and tp[k].device == dev and torch.equal(tp[k].cpu().view(torch.uint8), v.view(torch.uint8)) "
            "and all(d[k].device == dev and torch.equal(d[k].cpu().view(torch.uint8), v.view(torch.uint8)) "
            "for d in (on_dev, on_dev_owned)) "
            "for k, v in want.items()), 'device': bool(blocks) and all(b == str(dev) for b in blocks)}\n",
            "tests/test_group_load.py checks a group of another backend")
        if got is None:
            return "skipped", skip
        ok = got["same"] and got["device"]
        return ("ok" if ok else "failed"), (f"load_into CUDA tensors, stream and load_file to the GPU and to the "
                                            f"CPU over an NCCL group of one: "
                                            f"bytes {'equal' if got['same'] else 'DIFFER'}; load_into's rounds "
                                            f"{'through device blocks over NCCL' if got['device'] else 'NOT on the device'}")

    def side_copy(per_tensor: bool) -> bool:
        """The largest tensor copied on a side stream that runs after the load is dropped and its
        memory handed out again; whether the copy has the file's bytes."""
        name = max(tensors, key=lambda k: tensors[k].nbytes)
        got = dict(engine.stream(path, framework="pt", device=str(target), per_tensor=per_tensor))
        side = torch.cuda.Stream(device=target)
        side.wait_stream(torch.cuda.current_stream(target))
        with torch.cuda.stream(side):
            out = torch.empty(tensors[name].nbytes, dtype=torch.uint8, device=target)
            torch.cuda._sleep(SLEEP_CYCLES // 2)  # the copy runs after what follows is queued
            out.copy_(got[name].view(-1).view(torch.uint8))
        got[name].record_stream(side)
        del got
        total = sum(v.nbytes for v in tensors.values())
        again = [torch.full((total // 4,), 0xFF, dtype=torch.uint8, device=target) for _ in range(4)]
        torch.cuda.synchronize()
        del again
        return torch.equal(out.cpu(), tensors[name].reshape(-1).view(torch.uint8))

    def recorded():
        held, shared = side_copy(True), side_copy(False)
        return ("ok" if held else "failed"), (f"the side stream's copy {'has' if held else 'LOST'} the file's bytes; "
                                              f"with per_tensor=False it {'has them' if shared else 'lost them'}")

    return [_row(name, fn) for name, fn in zip(ROWS, (stale, current, ordered, contexts, fork, windowed, cupy_contexts,
                                                      cupy_only, nccl, nccl_group, recorded), strict=True)]


def emulated_rows(folder: str) -> list[dict]:
    """Rows 1, 2 and 5 on the emulated runtime: the ring's loads through the pipeline."""
    import numpy as np
    from emucudart import EmulatedRingOps, Emulator

    import engine
    from engine.gpu import rings
    from engine.loading import pipeline
    from engine.planning.plan import plan_reads

    path, arrays = _checkpoint(folder)
    header = engine.read_header(path)
    emu = Emulator()
    emu.reset()
    emu.devices(2)
    ops = EmulatedRingOps(emu, device=1)

    def load() -> bool:
        t = header.table
        rows = list(range(len(t.names)))
        dst = {r: bytearray(int(t.ends[r]) - int(t.begins[r])) for r in rows}
        emu.delay(0.0005)  # copies still running at the polls
        with open(path, "rb") as f:
            src = pipeline.Source(f.fileno(), path, plan_reads(t.begins, t.ends, rows, header.data_start, 8 << 20))
            pipeline.run_sources([src], pipeline.Destination(device_targets=dst, device_ops=ops), slot_bytes=4 << 20)
        emu.delay(0)
        return all(bytes(dst[r]) == np.ascontiguousarray(arrays[n]).tobytes() for r, n in enumerate(t.names))

    def stale():
        ok = load()
        err = emu.last_error()
        return ("ok" if ok and err == 0 else "failed"), f"cudaGetLastError {err} after the load (emulated runtime)"

    def current():
        emu.set_device(0)
        rings.release_rings()  # the load sets its ring up on this thread
        ok = load()
        after = emu.current_device()
        return ("ok" if ok and after == 0 else "failed"), f"current device 0 before, {after} after a load to device 1 (emulated runtime)"

    def elsewhere(test: str = "tests/test_device_ring.py", on: str = "the emulated runtime"):
        return lambda: ("skipped", f"no CUDA device: {test} checks it on {on}")

    try:
        return [_row(name, fn) for name, fn in zip(ROWS, (stale, current, elsewhere(), elsewhere(),
                                                          lambda: _fork_row(load, path, arrays),
                                                          elsewhere("tests/test_hooked_ring.py"),
                                                          elsewhere("tests/test_load_hooks.py"),
                                                          elsewhere("tests/test_cudart.py"),
                                                          elsewhere(),
                                                          elsewhere("tests/test_group_load.py"),
                                                          elsewhere("tests/test_torch.py", "the CPU as the device")), strict=True)]
    finally:
        rings.release_rings()
        ops.close()
        emu.devices(1)


def rows(device: str, folder: str) -> list[dict]:
    """The rows on ``device`` (``cpu``: the emulated runtime), the small checkpoint in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    return cuda_rows(device, folder) if device.startswith("cuda") else emulated_rows(folder)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the emulated runtime")
    ap.add_argument("--dir", required=True, help="a folder for the small checkpoint")
    a = ap.parse_args(argv)
    print(json.dumps({"rows": rows(a.device, a.dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
