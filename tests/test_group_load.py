"""engine.apps.group_load: ``load_file(..., process_group=...)`` on real gloo ranks (two
processes on 127.0.0.1): every rank returns every tensor byte-equal to the file, the group
reads each byte once (a server counts the bytes asked for), and a read that fails on one rank
fails the load on every rank instead of leaving the others waiting."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra")
if not torch.distributed.is_available():  # pragma: no cover - depends on the torch build
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serving  # noqa: E402
from servers import free_port  # noqa: E402

import engine  # noqa: E402
import engine.numpy  # noqa: E402
from engine.apps.group_load import spans  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import hashlib, json, os, sys
import numpy as np
import torch, torch.distributed as dist
import engine, engine.numpy, engine.torch
from engine.net.retry import Retry
rank, world, port, source, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
source = source.split("|")[rank] if "|" in source else source  # a source per rank, where they differ
if os.environ.get("GROUP_TEST_DIE") == str(rank):  # this rank dies in its reads, as a killed process does
    import engine.io.reader
    engine.io.reader.pread_into = lambda *a, **k: os._exit(3)
if os.environ.get("GROUP_TEST_STALL") == str(rank):  # this rank's reads hang, as on a stalled mount
    import threading, time
    import engine.io.reader
    _pread = engine.io.reader.pread_into
    def _stalled(*a, **k):
        if threading.current_thread().name.startswith("engine-group"):
            time.sleep(30)
        return _pread(*a, **k)
    engine.io.reader.pread_into = _stalled
if os.environ.get("GROUP_TEST_INTERRUPT") == str(rank):  # Ctrl-C on this rank while its reads run
    import signal, threading
    import engine.io.reader
    _pread_i, _sent = engine.io.reader.pread_into, []
    def _interrupting(*a, **k):
        if threading.current_thread().name.startswith("engine-group") and not _sent:
            _sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return _pread_i(*a, **k)
    engine.io.reader.pread_into = _interrupting
if os.environ.get("GROUP_TEST_COMMIT_FAILS") == str(rank):  # linking this rank's cache_dir copy fails
    import contextlib
    import engine.apps.group_load as gl
    _real_parts = gl._parts
    @contextlib.contextmanager
    def _failing_commit(*a, **k):
        with _real_parts(*a, **k) as got:
            def fail():
                raise OSError(28, "No space left on device (the test's)")
            yield (got[0], fail, *got[2:])
    gl._parts = _failing_commit
framework, members, mode = sys.argv[6], [int(x) for x in sys.argv[7].split(",")], sys.argv[8]
opts = json.loads(os.environ.get("GROUP_TEST_OPTS", "{}")).get(str(rank), {})  # options of this rank
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
if os.environ.get("GROUP_TEST_HOSTS"):  # the machine each rank runs on, as ranks on several would name theirs
    import socket
    socket.gethostname = (lambda h: lambda: h)(os.environ["GROUP_TEST_HOSTS"].split(",")[rank])
counted, counted_lock = [0], __import__("threading").Lock()
if os.environ.get("GROUP_TEST_COUNT"):  # the bytes this rank's rounds read from its files
    import threading
    import engine.io.reader
    _pread_c = engine.io.reader.pread_into
    def _counting(fd, offset, dsts, **k):
        if threading.current_thread().name.startswith("engine-group"):
            with counted_lock:
                counted[0] += sum(memoryview(d).nbytes for d in dsts)
        return _pread_c(fd, offset, dsts, **k)
    engine.io.reader.pread_into = _counting
device_blocks = []
if os.environ.get("GROUP_TEST_DEVICE_PAYLOADS") in ("all", str(rank)):  # the stand-in for NCCL and CUDA
    import engine.apps.group_load as gl
    gl.DEVICE_PAYLOADS, gl.PAYLOAD_DEVICES = frozenset({"gloo"}), frozenset({"cpu"})
    _device_block = gl._device_block
    gl._device_block = lambda n, d: (device_blocks.append(n), _device_block(n, d))[1]
if os.environ.get("GROUP_TEST_HOST_DEVICES") is not None:  # "cpu" plays a device the tensors are copied to
    import engine.apps.group_load as gl
    gl.HOST_DEVICES = frozenset(filter(None, os.environ["GROUP_TEST_HOST_DEVICES"].split(",")))
group = dist.group.WORLD if len(members) == world else dist.new_group(members)  # every rank makes it
if os.environ.get("GROUP_TEST_BACKEND"):  # the group as another backend makes it (its collectives are not gloo's)
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    group = dist.new_group(members, backend=os.environ["GROUP_TEST_BACKEND"])
if rank not in members:  # not in the group: loads nothing
    with open(out, "w") as f:
        json.dump({"outside": True}, f)
    dist.barrier(); os._exit(0)
kw = {"timeout": 5.0, "retry": Retry(attempts=2, base=0.01, cap=0.02)} if "://" in source else {}
if source.startswith("s3://"):  # the test's Range server as an anonymous path-style bucket
    kw["s3"] = {"endpoint_url": os.environ["GROUP_TEST_S3"], "anonymous": True}
kw.update(opts)
order = []
try:
    if mode == "stream":
        got = {}
        for k, v in engine.stream(source, framework=framework, process_group=group, **kw):
            got[k] = v; order.append(k)
    elif mode.startswith("stop"):  # rank 1's consumer raises (or breaks) after 2 tensors and lives on
        got = {}
        for k, v in engine.stream(source, framework=framework, process_group=group, **kw):
            got[k] = v; order.append(k)
            if rank == 1 and len(got) == 2:
                if mode == "stop-break":
                    break
                try:
                    raise ValueError("the consumer's own error")
                except ValueError:
                    break
        if rank == 1:  # alive until the others are done: they must not need this process to exit
            import glob, time
            others = [os.path.join(os.path.dirname(out), f"rank{r}.json") for r in range(world) if r != 1]
            for _ in range(1200):
                if all(os.path.exists(o) for o in others):
                    break
                time.sleep(0.1)
            order = {"others_done_first": all(os.path.exists(o) for o in others), "got": len(got)}
    elif mode == "into":
        shapes = json.loads(os.environ["GROUP_TEST_SHAPES"])
        devices = os.environ.get("GROUP_TEST_DEVICE", "cpu").split(",")  # one for all, or one per rank
        device = devices[rank % len(devices)]
        got = {k: torch.zeros(shape, dtype=getattr(torch, dt), device=device) for k, (shape, dt) in shapes.items()}
        order = engine.load_into(source, got, process_group=group, **kw)
    elif mode == "hooks":  # stats and int8 on every rank's landed bytes
        got, hooks = {}, {}
        for name, t, st in engine.stream(source, framework="numpy", process_group=group, stats=True, quantize="int8"):
            q = isinstance(t, tuple)
            got[name] = np.concatenate([t.q.reshape(-1).view(np.uint8), t.scale.reshape(-1).view(np.uint8)]) if q else t
            hooks[name] = [q, repr(st)]
        order = hooks
    elif mode == "release":  # the engine's own use: each tensor copied before the next step
        from engine.apps.group_load import stream
        got = {}
        for k, v in stream(source, group, framework="numpy", _release=True, **kw):
            got[k] = v.copy()
    elif framework == "numpy":
        got = engine.numpy.load_file(source, process_group=group, **kw)
    else:
        got = engine.torch.load_file(source, process_group=group, **kw)
    raw = {k: (np.ascontiguousarray(v).tobytes() if isinstance(v, np.ndarray)
               else v.contiguous().view(torch.uint8).numpy().tobytes()) for k, v in got.items()}
    result = {"tensors": {k: hashlib.sha256(b).hexdigest() for k, b in raw.items()}, "order": order,
              "read": counted[0], "device_blocks": len(device_blocks)}
except BaseException as exc:  # (KeyboardInterrupt too)
    import threading  # the group's reader threads are joined before the error comes out
    alive = [t.name for t in threading.enumerate() if t.name.startswith("engine-group")]
    result = {"error": type(exc).__name__, "threads_left": alive, "reason": getattr(exc, "reason", None), "message": str(exc),
              "rank": getattr(exc, "rank", None), "cause": getattr(exc, "cause", None),
              "chained": type(exc.__cause__).__name__ if exc.__cause__ is not None else None}
with open(out, "w") as f:
    json.dump(result, f)
if "GROUP_TEST_DIE" not in os.environ:  # (a dead rank meets no barrier)
    dist.barrier()  # every rank done before any leaves
os._exit(0)  # no interpreter teardown: gloo's threads may abort the process there ("terminate called ...")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    rng = np.random.default_rng(5)
    sd = {f"layers.{i}.w": rng.standard_normal((128, 100 + 3 * i), dtype=np.float32) for i in range(7)}
    sd["norm"] = rng.standard_normal(333).astype(np.float16)
    sd["empty"] = np.zeros((0, 4), np.int8)
    engine.save_sharded(sd, str(root / "sharded"), max_shard_size=150_000, checksums=True)
    engine.save_file(sd, str(root / "one.safetensors"), checksums=True)
    return root, sd


def _digests(sd: dict) -> dict:
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in sd.items()}


def _ranks(source: str, tmp_path, world: int = 2, framework: str = "pt", members: list[int] | None = None,
           die: int | None = None, mode: str = "load", opts: dict | None = None, env: dict | None = None) -> list[dict]:
    """What each of ``world`` ranks (processes) got from loading ``source`` together: the
    digest of each tensor, or the error.  ``opts``: options per rank ``{rank: {...}}``."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    env["GROUP_TEST_OPTS"] = json.dumps({str(k): v for k, v in (opts or {}).items()})
    if die is not None:
        env["GROUP_TEST_DIE"] = str(die)
    outs = [str(tmp_path / f"rank{r}.json") for r in range(world)]
    group = ",".join(str(m) for m in (members if members is not None else range(world)))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), str(port), source, outs[r], framework,
                               group, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=120)
            assert p.returncode == (3 if r == die else 0), err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.load(open(o)) if r != die else {"died": True} for r, o in enumerate(outs)]


@pytest.mark.parametrize(("where", "framework"), [("one.safetensors", "pt"), ("sharded", "pt"),
                                                  ("sharded/model.safetensors.index.json", "numpy")])
def test_every_rank_returns_every_tensor_of_a_local_checkpoint(checkpoint, tmp_path, where, framework):
    root, sd = checkpoint
    for got in _ranks(str(root / where), tmp_path, framework=framework):
        assert got.get("tensors") == _digests(sd), got


def test_a_group_of_another_backend_loads_over_a_gloo_group_of_its_ranks(checkpoint, tmp_path):
    """The group given is not gloo's (torch's "fake" backend, whose collectives do nothing: the
    stand-in on a CPU host for an NCCL group, whose collectives need CUDA tensors): the ranks
    agree and exchange over a gloo group of the same ranks, and every rank has every tensor."""
    root, sd = checkpoint
    for got in _ranks(str(root / "sharded"), tmp_path, env={"GROUP_TEST_BACKEND": "fake"}):
        assert got.get("tensors") == _digests(sd), got


REINIT = r"""
import json, socket, sys
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
import engine.torch
out = []
for _ in range(2):  # a process that sets its group up, loads, tears it down and starts again
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0], backend="fake")  # the same name both times: the gloo group derived from it must be new
    try:
        out.append(len(engine.torch.load_file(sys.argv[1], process_group=group)))
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    dist.destroy_process_group()
print("RESULT", json.dumps(out))
"""


def test_a_process_that_starts_its_group_again_loads_again(checkpoint):
    """The gloo group made for a group of another backend is made again once torch has dropped
    it (``destroy_process_group``), not taken from the cache by a new group's equal name."""
    root, sd = checkpoint
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", REINIT, str(root / "one.safetensors")], env=env,
                          capture_output=True, text=True, timeout=120)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    assert json.loads(line[len("RESULT "):]) == [len(sd), len(sd)], done.stdout + done.stderr[-2000:]


def test_a_sub_group_loads_as_the_world_does(checkpoint, tmp_path):
    """Ranks 1 and 2 of three form a group (``new_group``): its ranks broadcast from their
    global ranks; rank 0, outside it, loads nothing."""
    root, sd = checkpoint
    outside, *inside = _ranks(str(root / "sharded"), tmp_path, world=3, members=[1, 2])
    assert outside == {"outside": True}
    for got in inside:
        assert got.get("tensors") == _digests(sd), got


def test_the_group_reads_each_byte_of_a_url_once(checkpoint, tmp_path):
    """Two ranks load the same URL: the server is asked for the tensors' bytes once in all,
    where two plain loads ask for them twice."""
    root, sd = checkpoint
    tensor_bytes = sum(v.nbytes for v in sd.values())
    with serving(str(root)) as server:
        server.bulk()
        for got in _ranks(server.url("sharded/model.safetensors.index.json"), tmp_path):
            assert got.get("tensors") == _digests(sd), got
        asked = server.tensor_bytes_asked()
    assert tensor_bytes <= asked <= 1.02 * tensor_bytes, (asked, tensor_bytes)


def _same_error_everywhere(results: list[dict], rank: int | None, cause: str, all_failed: bool = False) -> None:
    """Every rank raised DistributedLoadError naming ``rank`` and a cause mentioning ``cause``;
    the failing rank's own error (every rank's, where ``all_failed``) is chained to it."""
    for k, got in enumerate(results):
        assert got.get("error") == "DistributedLoadError" and got["reason"] == "GroupReadFailed", got
        assert got["threads_left"] == [], got
        assert got["rank"] == rank and cause in got["cause"], got
        assert (got["chained"] is not None) == (all_failed or k == rank), got


def test_a_failed_read_on_every_rank_fails_every_rank_with_the_first_cause(checkpoint, tmp_path):
    root, sd = checkpoint
    with serving(str(root)) as server:
        server.bulk()
        server.faults = lambda n, path, first, last: "403"  # every data GET is refused
        results = _ranks(server.url("sharded/model.safetensors.index.json"), tmp_path)
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["rank"] == 0 and "AccessDenied" in got["cause"], got


@pytest.mark.parametrize("fault", ["404", "reset"])
def test_a_read_that_fails_on_one_ranks_share_reaches_every_rank(checkpoint, tmp_path, fault):
    """Only the second half of the file fails (a 404, or a connection reset on every try):
    rank 1's share.  Both ranks raise the same named error, naming rank 1 and its cause."""
    root, sd = checkpoint
    size = os.path.getsize(root / "one.safetensors")
    with serving(str(root)) as server:
        server.bulk()
        server.faults = lambda n, path, first, last: fault if first >= size // 2 else None
        results = _ranks(server.url("one.safetensors"), tmp_path)
    _same_error_everywhere(results, 1, "NotFound" if fault == "404" else "Error")


def _damaged(root, tmp_path) -> None:
    """``bad.safetensors`` in ``tmp_path``: ``one.safetensors`` with a byte in the middle of its
    last large tensor flipped."""
    data = bytearray((root / "one.safetensors").read_bytes())
    header = engine.read_header(str(root / "one.safetensors"))
    begin, end = header["layers.6.w"].data_offsets
    data[header.data_start + (begin + end) // 2] ^= 0x10
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))


@pytest.mark.parametrize("bucket", [None, 4096])
def test_a_damaged_tensor_in_one_ranks_share_fails_every_rank(checkpoint, tmp_path, bucket):
    """A byte in the middle of the last large tensor flipped on disk.  In one round of the whole
    file, rank 1 reads all of it: its checksum fails on rank 1 before anything is sent, and rank
    0 hears why.  In rounds of 4 KiB the tensor is a round alone, shared by both ranks: it fails
    on every rank once it came."""
    root, sd = checkpoint
    _damaged(root, tmp_path)
    opts = {r: {"bucket_bytes": bucket} for r in range(2)} if bucket else None
    results = _ranks(str(tmp_path / "bad.safetensors"), tmp_path, opts=opts)
    _same_error_everywhere(results, None if bucket else 1, "ChecksumError", all_failed=bucket is not None)


def test_ranks_given_different_checkpoints_fail_together(checkpoint, tmp_path):
    """A rank that sees another checkpoint than the others: every rank fails, none waits
    forever or returns a mix of two files."""
    root, sd = checkpoint
    engine.save_file({"x": np.ones(3, np.float32)}, str(root / "other.safetensors"))
    results = _ranks(f"{root / 'one.safetensors'}|{root / 'other.safetensors'}", tmp_path)
    assert [(r["error"], r["reason"]) for r in results] == [("DistributedLoadError", "GroupMismatch")] * 2, results


def _data_bytes(*files) -> int:
    return sum(engine.read_header(str(f)).data_size for f in files)


@pytest.mark.parametrize("where", ["one.safetensors", "sharded", "sharded/model.safetensors.index.json"])
def test_a_rank_without_a_copy_is_served_by_the_ranks_that_have_one(checkpoint, tmp_path, where):
    """Rank 1's source does not exist (a machine without the files): it takes the headers from
    rank 0 and reads nothing; ranks 0 and 2 read every byte once between them, and every rank
    returns every tensor."""
    root, sd = checkpoint
    size = _data_bytes(root / "one.safetensors") if where.startswith("one") else \
        _data_bytes(*(root / "sharded").glob("*.safetensors"))
    sources = [str(root / where), str(tmp_path / "nowhere" / where), str(root / where)]
    results = _ranks("|".join(sources), tmp_path, world=3, env={"GROUP_TEST_COUNT": "1"})
    for got in results:
        assert got.get("tensors") == _digests(sd), got
    assert results[1]["read"] == 0 and results[0]["read"] > 0 and results[2]["read"] > 0, results
    assert results[0]["read"] + results[2]["read"] == size, results


def test_no_rank_with_a_copy_fails_every_rank_naming_the_first(checkpoint, tmp_path):
    results = _ranks(str(tmp_path / "nowhere.safetensors"), tmp_path)
    _same_error_everywhere(results, 0, "FileNotFoundError", all_failed=True)


def test_a_copy_that_lacks_a_shard_fails_every_rank(checkpoint, tmp_path):
    """A folder that is there but incomplete is a broken copy, not a missing one: every rank fails."""
    import shutil

    root, sd = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(root / "sharded", broken)
    next(broken.glob("*-of-*.safetensors")).unlink()
    results = _ranks(f"{root / 'sharded'}|{broken}", tmp_path)
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["rank"] == 1, got


@pytest.mark.parametrize(("reads", "copies"), [("node", "all"), ("group", "all"), ("node", "node a")])
def test_each_machine_reads_the_checkpoint_once_or_the_group_does(checkpoint, tmp_path, reads, copies):
    """Four ranks on two machines (a, a, b, b; the host name each rank sees is the test's).  With
    ``reads="node"`` (the default) each machine's ranks read every byte once between them and no
    byte crosses between machines; with ``"group"`` the four read every byte once.  Where machine
    b has no copy, its ranks are served by a's, as with ``"group"``."""
    root, sd = checkpoint
    size = _data_bytes(*(root / "sharded").glob("*.safetensors"))
    here, gone = str(root / "sharded"), str(tmp_path / "nowhere")
    sources = [here, here, here, here] if copies == "all" else [here, here, gone, gone]
    opts = {r: {"reads": reads} for r in range(4)} if reads != "node" else None
    mode = "load" if reads == "group" else "stream"  # an owned load's one block, and a stream's rounds
    results = _ranks("|".join(sources), tmp_path, world=4, mode=mode, opts=opts,
                     env={"GROUP_TEST_COUNT": "1", "GROUP_TEST_HOSTS": "a,a,b,b"})
    for got in results:
        assert got.get("tensors") == _digests(sd), got
    read = [got["read"] for got in results]
    if reads == "node" and copies == "all":
        assert read[0] + read[1] == size and read[2] + read[3] == size and min(read) > 0, read
    elif copies == "all":
        assert sum(read) == size and min(read) > 0, read
    else:
        assert read[0] + read[1] == size and read[2] == read[3] == 0, read


def test_ranks_that_ask_for_different_reads_fail_together(checkpoint, tmp_path):
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, opts={1: {"reads": "group"}})
    assert [(r["error"], r["reason"]) for r in results] == [("DistributedLoadError", "GroupMismatch")] * 2, results


def _rewrite_header(path, change) -> None:
    """``change(header dict)`` written back in place (the same length, padded with spaces)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    data[8 : 8 + n] = new + b" " * (n - len(new))
    path.write_bytes(bytes(data))


def test_copies_that_record_different_checksums_fail_together(checkpoint, tmp_path):
    """One rank's copy records checksums, the other's does not (same tensors, same offsets):
    they would check different things, so both refuse before any exchange."""
    root, sd = checkpoint
    engine.save_file(sd, str(tmp_path / "plain.safetensors"))
    results = _ranks(f"{root / 'one.safetensors'}|{tmp_path / 'plain.safetensors'}", tmp_path)
    assert [r.get("reason") for r in results] == ["GroupMismatch", "GroupMismatch"], results


def test_a_header_that_fails_its_checksum_fails_every_rank_before_the_exchange(checkpoint, tmp_path):
    root, sd = checkpoint
    path = tmp_path / "renamed.safetensors"
    path.write_bytes((root / "one.safetensors").read_bytes())
    _rewrite_header(path, lambda h: h.__setitem__("layers.0.x", h.pop("layers.0.w")))  # the JSON still parses
    _same_error_everywhere(_ranks(str(path), tmp_path), 0, "ChecksumError", all_failed=True)


def test_an_empty_tensor_whose_recorded_checksum_is_wrong_fails_as_the_plain_load_does(checkpoint, tmp_path):
    root, sd = checkpoint
    path = tmp_path / "empty.safetensors"
    path.write_bytes((root / "one.safetensors").read_bytes())

    def damage(h):  # the entry's digits: format, the header's CRC, then one per tensor in file order
        order = sorted((k for k in h if k != "__metadata__"), key=lambda k: tuple(h[k]["data_offsets"]))
        value, at = h["__metadata__"]["engine.crc32c"], 2 + 8 + 8 * order.index("empty")
        h["__metadata__"]["engine.crc32c"] = value[:at] + "deadbeef" + value[at + 8 :]

    _rewrite_header(path, damage)
    with pytest.raises(engine.ChecksumError):
        engine.numpy.load_file(str(path))
    _same_error_everywhere(_ranks(str(path), tmp_path), 0, "ChecksumError", all_failed=True)


def test_copies_of_two_revisions_with_one_header_are_refused_on_every_rank(checkpoint, tmp_path):
    """Rank 1's copy has the same header (names, dtypes, shapes, offsets; no checksums, as most
    checkpoints) and other bytes in every tensor: every rank refuses, none returns a mix."""
    root, sd = checkpoint
    rng = np.random.default_rng(11)
    engine.save_file(sd, str(tmp_path / "a.safetensors"))
    engine.save_file({k: rng.standard_normal(v.shape).astype(v.dtype) if v.size else v for k, v in sd.items()},
                     str(tmp_path / "b.safetensors"))
    a, b = (tmp_path / "a.safetensors").read_bytes(), (tmp_path / "b.safetensors").read_bytes()
    assert a[: 8 + int.from_bytes(a[:8], "little")] == b[: 8 + int.from_bytes(b[:8], "little")] and a != b
    results = _ranks(f"{tmp_path / 'a.safetensors'}|{tmp_path / 'b.safetensors'}", tmp_path)
    assert [r.get("reason") for r in results] == ["GroupMismatch", "GroupMismatch"], results


def test_ranks_given_different_options_fail_at_once(checkpoint, tmp_path):
    """Checksums checked on one rank only would pair different collectives: both ranks refuse."""
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, opts={1: {"verify_checksums": False}})
    assert [r["reason"] for r in results] == ["GroupMismatch", "GroupMismatch"], results


def test_a_read_stalled_past_the_deadline_fails_every_rank(checkpoint, tmp_path):
    """Rank 1's reads hang (30 s, as on a stalled network mount) and ``read_deadline`` is 1 s:
    both ranks raise naming rank 1 and the deadline, and rank 1 does not wait for its stuck
    reader to end first."""
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, opts={r: {"read_deadline": 1.0} for r in (0, 1)},
                     env={"GROUP_TEST_STALL": "1"})
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["rank"] == 1, got
        assert "read_deadline=1 s" in got["cause"], got
    assert results[1]["threads_left"] != [], results[1]  # its reader is still stuck, left behind


def test_ctrl_c_on_one_rank_reaches_the_others(checkpoint, tmp_path):
    """SIGINT on rank 1 while it waits for its reads: rank 1 gets its KeyboardInterrupt, and rank 0
    raises DistributedLoadError naming rank 1 instead of waiting in a collective."""
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, env={"GROUP_TEST_INTERRUPT": "1"},
                     opts={r: {"bucket_bytes": 8192} for r in (0, 1)})
    assert results[1].get("error") == "KeyboardInterrupt", results[1]
    assert results[0].get("error") == "DistributedLoadError" and results[0]["rank"] == 1, results[0]
    assert "KeyboardInterrupt" in results[0]["cause"], results[0]


def test_a_cache_dir_copy_failing_on_one_rank_after_the_last_round_fails_every_rank(checkpoint, tmp_path):
    """Rank 1 keeps a local copy and its last step (the copy linked into place) fails after the
    last exchange: rank 0 does not return as if the group's load had succeeded."""
    root, sd = checkpoint
    with serving(str(root)) as server:
        server.bulk()
        results = _ranks(server.url("one.safetensors"), tmp_path, env={"GROUP_TEST_COMMIT_FAILS": "1"},
                         opts={1: {"cache_dir": str(tmp_path / "cache")}})
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["rank"] == 1, got
        assert "No space left" in got["cause"], got


def test_a_rank_that_dies_mid_load_makes_the_others_raise(checkpoint, tmp_path):
    """Rank 1 exits in the middle of its reads (as a killed process): rank 0 raises, naming the
    source, instead of waiting for a span that will never come."""
    root, sd = checkpoint
    alive, dead = _ranks(str(root / "sharded"), tmp_path, die=1)
    assert dead == {"died": True}
    assert alive.get("error") == "DistributedLoadError" and alive["reason"] == "GroupFailed", alive


@pytest.mark.parametrize("world", [2, 4])
def test_small_buckets_exchange_in_many_rounds(checkpoint, tmp_path, world):
    """Buckets of 4 KiB and reads of 1000 bytes: many rounds, tensors split between ranks and
    between buckets, pieces cut at a bucket's end; every rank still gets every tensor."""
    root, sd = checkpoint
    opts = {r: {"bucket_bytes": 4096, "chunk_bytes": 1000} for r in range(world)}
    for got in _ranks(str(root / "sharded"), tmp_path, world=world, opts=opts):
        assert got.get("tensors") == _digests(sd), got


def test_a_stream_yields_every_tensor_once_on_every_rank(checkpoint, tmp_path):
    root, sd = checkpoint
    opts = {r: {"bucket_bytes": 8192} for r in range(2)}
    for got in _ranks(str(root / "sharded"), tmp_path, mode="stream", framework="numpy", opts=opts):
        assert got.get("tensors") == _digests(sd), got
        assert sorted(got["order"]) == sorted(sd), got


@pytest.mark.parametrize("how", ["stop", "stop-break"])
def test_a_consumer_that_stops_on_one_rank_fails_the_others_while_it_lives_on(checkpoint, tmp_path, how):
    """3 ranks; rank 1's consumer raises (or breaks out) after its second tensor and its process
    lives on, as a server's worker does: ranks 0 and 2 raise DistributedLoadError naming rank
    1 at their next agreement, and finish while rank 1 is still alive."""
    root, sd = checkpoint
    opts = {r: {"bucket_bytes": 8192} for r in range(3)}
    results = _ranks(str(root / "sharded"), tmp_path, world=3, mode=how, framework="numpy", opts=opts)
    assert results[1]["order"] == {"others_done_first": True, "got": 2}, results[1]
    for got in (results[0], results[2]):
        assert got.get("error") == "DistributedLoadError" and got["reason"] == "GroupReadFailed", got
        assert got["rank"] == 1 and "stopped the load" in got["cause"], got


def test_an_option_on_one_rank_only_fails_every_rank(checkpoint, tmp_path):
    """An option a group load does not take, on rank 1 only: rank 0 is not left in a collective."""
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, opts={1: {"names": ["norm"]}})
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["rank"] == 1 and "TypeError" in got["cause"], got
    assert results[1]["chained"] == "TypeError"


def test_load_into_fills_every_ranks_tensors(checkpoint, tmp_path):
    root, sd = checkpoint
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    for got in _ranks(str(root / "sharded"), tmp_path, mode="into", env={"GROUP_TEST_SHAPES": json.dumps(shapes)}):
        assert got.get("tensors") == _digests(sd), got
        assert sorted(got["order"]) == sorted(sd), got


@pytest.mark.parametrize(("where", "bucket"), [("sharded", None), ("one.safetensors", 4096)])
def test_load_into_sends_the_rounds_through_device_memory_where_the_backend_moves_it(checkpoint, tmp_path, where,
                                                                                    bucket):
    """The stand-in for an NCCL group filling CUDA tensors: gloo plays the backend whose
    collectives move device memory and the CPU the device, so the rounds go through the
    device path (each share copied up, broadcast between device blocks, copied into the
    destinations; split tensors, 4 KiB rounds, come back to the host for their checksums)."""
    root, sd = checkpoint
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    opts = {r: {"bucket_bytes": bucket} for r in range(3)} if bucket else None
    results = _ranks(str(root / where), tmp_path, world=3, mode="into", opts=opts,
                     env={"GROUP_TEST_SHAPES": json.dumps(shapes), "GROUP_TEST_DEVICE_PAYLOADS": "all"})
    for got in results:
        assert got.get("tensors") == _digests(sd), got
        assert got["device_blocks"] == (1 if bucket is None else 2), got  # one round; or the window's two, reused


def test_a_damaged_tensor_sent_through_device_memory_fails_every_rank(checkpoint, tmp_path):
    root, sd = checkpoint
    _damaged(root, tmp_path)
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    results = _ranks(str(tmp_path / "bad.safetensors"), tmp_path, mode="into", opts={r: {"bucket_bytes": 4096} for r in range(2)},
                     env={"GROUP_TEST_SHAPES": json.dumps(shapes), "GROUP_TEST_DEVICE_PAYLOADS": "all"})
    _same_error_everywhere(results, None, "ChecksumError", all_failed=True)


@pytest.mark.parametrize(("mode", "payloads"), [("load", "device"), ("stream", "device"), ("stream", "host")])
def test_a_group_load_to_a_device_hands_out_tensors_of_their_own_there(checkpoint, tmp_path, mode, payloads):
    """``load_file``/``stream`` with ``process_group`` and a device: the stand-in plays the CPU as
    that device (and, for ``"device"`` payloads, gloo as NCCL): rounds in the window's two
    blocks (device blocks, or host blocks copied up tensor by tensor), every rank every tensor."""
    root, sd = checkpoint
    env = {"GROUP_TEST_HOST_DEVICES": ""}
    if payloads == "device":
        env["GROUP_TEST_DEVICE_PAYLOADS"] = "all"
    results = _ranks(str(root / "one.safetensors"), tmp_path, world=3, mode=mode, env=env,
                     opts={r: {"device": "cpu", "bucket_bytes": 4096} for r in range(3)})
    for got in results:
        assert got.get("tensors") == _digests(sd), got
        assert got["device_blocks"] == (2 if payloads == "device" else 0), got


def test_a_group_load_to_a_device_refuses_what_it_cannot_hand_out_there(checkpoint, tmp_path):
    """numpy arrays (or stats, or int8) for a device: a DeviceError on every rank, at the agreement."""
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, framework="numpy", mode="stream",
                     env={"GROUP_TEST_HOST_DEVICES": ""}, opts={r: {"device": "cpu"} for r in range(2)})
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["cause"].startswith("DeviceError"), got


def test_ranks_whose_payloads_would_travel_differently_fail_together(checkpoint, tmp_path):
    """Rank 0 would send through device memory, rank 1 through the host: a GroupMismatch, not
    two ranks waiting in different collectives."""
    root, sd = checkpoint
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    results = _ranks(str(root / "one.safetensors"), tmp_path, mode="into",
                     env={"GROUP_TEST_SHAPES": json.dumps(shapes), "GROUP_TEST_DEVICE_PAYLOADS": "0"})
    assert [(r["error"], r["reason"]) for r in results] == [("DistributedLoadError", "GroupMismatch")] * 2, results


def test_load_into_a_wrong_destination_fails_every_rank_before_reading(checkpoint, tmp_path):
    root, sd = checkpoint
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    shapes["norm"] = [[3], "float16"]
    results = _ranks(str(root / "one.safetensors"), tmp_path, mode="into", env={"GROUP_TEST_SHAPES": json.dumps(shapes)})
    _same_error_everywhere(results, 0, "TensorMismatchError", all_failed=True)


def test_each_rank_that_asks_keeps_a_complete_local_copy(checkpoint, tmp_path):
    """``cache_dir`` per rank: each rank writes the bytes it read and those it received, so both
    copies are complete; the next group load reads them and asks the server for no tensor byte."""
    root, sd = checkpoint
    opts = {r: {"cache_dir": str(tmp_path / f"cache{r}")} for r in range(2)}
    with serving(str(root)) as server:
        server.bulk()
        server.etags = True
        url = server.url("sharded/model.safetensors.index.json")
        for got in _ranks(url, tmp_path, opts=opts):
            assert got.get("tensors") == _digests(sd), got
        first = server.tensor_bytes_asked()
        server.requests.clear()
        for got in _ranks(url, tmp_path, opts=opts):
            assert got.get("tensors") == _digests(sd), got
        again = server.tensor_bytes_asked()
    shards = sorted(p.name for p in (root / "sharded").glob("*.safetensors"))
    for r in range(2):
        copies = sorted((tmp_path / f"cache{r}").glob("*.safetensors"))
        assert len(copies) == len(shards)
        for c in copies:
            original = next(root / "sharded" / s for s in shards if c.name.endswith(s))
            assert c.read_bytes() == original.read_bytes()
    assert first >= sum(v.nbytes for v in sd.values()) and again == 0, (first, again)


def test_stats_and_int8_run_on_every_ranks_landed_bytes(checkpoint, tmp_path):
    """``stream(stats=True, quantize="int8")`` with a group yields what the plain stream of the
    same file yields, on every rank."""
    pytest.importorskip("numba", reason="stats and int8 need the kernels extra (Numba)")
    root, sd = checkpoint
    path = str(root / "one.safetensors")
    want, hooks = {}, {}
    for name, t, st in engine.stream(path, framework="numpy", stats=True, quantize="int8"):
        q = isinstance(t, tuple)
        raw = np.concatenate([t.q.reshape(-1).view(np.uint8), t.scale.reshape(-1).view(np.uint8)]) if q else t
        want[name] = hashlib.sha256(np.ascontiguousarray(raw).tobytes()).hexdigest()
        hooks[name] = [q, repr(st)]
    assert sum(q for q, _ in hooks.values()) >= 5
    for got in _ranks(path, tmp_path, mode="hooks"):
        assert got.get("tensors") == want and got["order"] == hooks, got


def _flip_once(at: int):
    """A server fault: the first GET that starts at file offset ``at`` gets a flipped byte."""
    state = {"done": False}

    def faults(n, path, first, last):
        if not state["done"] and first == at:
            state["done"] = True
            return "flip"
        return None

    return faults, state


def test_a_tensor_in_many_buckets_damaged_on_the_way_is_read_again_and_sent_again(checkpoint, tmp_path):
    """A tensor read whole by rank 0 spans many 4 KiB buckets; its first piece comes back with
    a flipped byte.  Every rank finds the mismatch once it came, rank 0 reads it again and sends
    it again: both ranks end with the file's bytes, and rank 1's local copy is whole."""
    root, sd = checkpoint
    path = root / "one.safetensors"
    faults, state = _flip_once(8 + int.from_bytes(path.read_bytes()[:8], "little"))
    opts = {0: {"bucket_bytes": 4096, "chunk_bytes": 1000},
            1: {"bucket_bytes": 4096, "chunk_bytes": 1000, "cache_dir": str(tmp_path / "cache")}}
    with serving(str(root)) as server:
        server.bulk()
        server.etags = True
        server.faults = faults
        results = _ranks(server.url("one.safetensors"), tmp_path, opts=opts)
    assert state["done"]
    for got in results:
        assert got.get("tensors") == _digests(sd), got
    (copy,) = (tmp_path / "cache").glob("*.safetensors")
    assert copy.read_bytes() == path.read_bytes()


def test_a_tensor_split_between_ranks_damaged_on_the_way_is_read_again_by_its_owners(checkpoint, tmp_path):
    """The byte flipped is in rank 1's half of the tensor that straddles the two spans: every
    rank sees the mismatch, the owners read their parts again and send them again."""
    root, sd = checkpoint
    path = root / "one.safetensors"
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    header = engine.read_header(str(path))
    middle = (os.path.getsize(path) - data_start) // 2  # about where the spans meet
    straddling = [k for k in header.keys() if header[k].data_offsets[0] < middle < header[k].data_offsets[1]]
    assert straddling
    faults, state = _flip_once(data_start + spans(sum(-(-v.nbytes // 64) * 64 for v in sd.values()), 2)[1][0])
    with serving(str(root)) as server:
        server.bulk()
        server.faults = faults
        results = _ranks(server.url("one.safetensors"), tmp_path)
    assert state["done"]
    for got in results:
        assert got.get("tensors") == _digests(sd), got


def test_a_bad_destination_on_one_rank_fails_every_rank_at_once(checkpoint, tmp_path):
    """Rank 1's destinations are on torch's meta device (nothing a load can fill): both ranks
    raise before anything is read, none waits for the other."""
    root, sd = checkpoint
    shapes = {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()}
    results = _ranks(str(root / "one.safetensors"), tmp_path, mode="into",
                     env={"GROUP_TEST_SHAPES": json.dumps(shapes), "GROUP_TEST_DEVICE": "cpu,meta"})
    _same_error_everywhere(results, 1, "DeviceError")


def test_options_a_group_load_does_not_take_fail_every_rank_naming_the_type_error(checkpoint, tmp_path):
    root, sd = checkpoint
    results = _ranks(str(root / "one.safetensors"), tmp_path, opts={r: {"names": ["norm"]} for r in range(2)})
    for got in results:
        assert got["error"] == "DistributedLoadError" and "TypeError" in got["cause"] and "names" in got["cause"], got


MEMORY_CHILD = r"""
import hashlib, json, os, resource, sys
import torch, torch.distributed as dist
import engine
rank, world, port, warm, source, out, mode = sys.argv[1:8]
rank, world, opts = int(rank), int(world), json.loads(sys.argv[8])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def load(path):
    h = hashlib.sha256()
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # (the warm-up's)
    if mode == "into":  # pre-faulted destinations: the memory a GPU would hold is not counted
        header = engine.read_header(path)
        dest = {k: torch.ones(header[k].shape, dtype=torch.float32) for k in header.keys()}
        base = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from here
        if "as_limit" in opts:  # the address space a full-size block would need is refused, as overcommit=2 does
            resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + opts["as_limit"], resource.RLIM_INFINITY))
        kw = {k: v for k, v in opts.items() if k != "as_limit"}
        names = engine.load_into(path, dest, process_group=dist.group.WORLD, **kw)
        for k in names:
            h.update(dest[k].view(torch.uint8).numpy())
    else:  # a consumer that keeps nothing it is handed
        base = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if mode == "stream":
            tensors = engine.stream(path, framework="pt", process_group=dist.group.WORLD, **opts)
        else:
            from engine.serving.weights import Weights, parse_options
            tensors = Weights(path, options=parse_options({"distributed": True, **opts}), group=dist.group.WORLD)
        for _, t in tensors:
            h.update(t.view(torch.uint8).numpy())
            del t
    return status("VmHWM") - base, h.hexdigest()


try:
    load(warm)  # the first use's imports and allocations, not the load's
    extra, digest = load(source)
    result = {"extra": extra, "digest": digest}
except Exception as exc:
    result = {"error": type(exc).__name__, "message": str(exc), "reason": getattr(exc, "reason", None)}
with open(out, "w") as f:
    json.dump(result, f)
dist.barrier()
os._exit(0)
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 64 MiB and a 256 MiB file of 2 MiB tensors (F32), the digest of each one's tensor bytes,
    and a small file for the warm-up."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(9)
    out = {}
    for mib in (64, 256):
        sd = {f"w{i}": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(mib // 2)}
        path = str(root / f"{mib}.safetensors")
        engine.save_file(sd, path)
        header = engine.read_header(path)
        order = sorted(sd, key=lambda k: header[k].data_offsets[0])  # the file's order, as the ranks hash
        out[mib] = (path, hashlib.sha256(b"".join(sd[k].tobytes() for k in order)).hexdigest())
    engine.save_file({"a": np.ones((64, 64), np.float32), "b": np.zeros(100, np.float32)}, str(root / "warm.safetensors"))
    return out, str(root / "warm.safetensors")


def _memory(source: str, warm: str, mode: str, world: int, opts: dict, tmp_path, env: dict | None = None) -> list[dict]:
    """Each rank's host memory beyond its outputs at the peak of a group load of ``source``
    (its peak RSS, reset when the load starts, less its RSS then) and its digest."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})}
    outs = [str(tmp_path / f"mem{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-c", MEMORY_CHILD, str(r), str(world), str(port), warm, source, outs[r],
                               mode, json.dumps(opts)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.load(open(o)) for o in outs]


MIB = 1 << 20


@pytest.mark.parametrize("mode", ["into", "stream", "weights"])
def test_a_memory_limit_bounds_a_group_load_on_every_rank(big, tmp_path, mode):
    """4 ranks, a 64 MiB file, ``memory_limit`` of 8 MiB: the node's host memory beyond the
    outputs stays within 0.6x the model (a block of the checkpoint's size on every rank would be
    4x), and every rank has the file's bytes."""
    files, warm = big
    path, digest = files[64]
    results = _memory(path, warm, mode, 4, {"memory_limit": 8 * MIB}, tmp_path)
    for got in results:
        assert got.get("digest") == digest, got
    extra = [got["extra"] for got in results]
    assert sum(extra) <= 0.6 * 64 * MIB, [e / MIB for e in extra]  # the node: 0.6x the model, not 4x


@pytest.mark.parametrize("mode", ["into", "stream", "weights"])
def test_the_default_plan_holds_a_window_of_rounds_not_the_checkpoint(big, tmp_path, mode):
    """Without a limit: two rounds of 32 MiB in flight, so a 256 MiB file costs each of 2 ranks
    well under half the model beyond its outputs (a block of the checkpoint's size: 1x)."""
    files, warm = big
    path, digest = files[256]
    results = _memory(path, warm, mode, 2, {}, tmp_path)
    for got in results:
        assert got.get("digest") == digest, got
    assert all(got["extra"] <= 0.5 * 256 * MIB for got in results), [got["extra"] / MIB for got in results]


def test_a_group_load_into_fits_where_a_checkpoint_sized_block_would_be_refused(big, tmp_path):
    """The address space beyond what each rank has mapped limited to half the model (as
    ``vm.overcommit_memory=2`` refuses a mapping it cannot back): a block of the checkpoint's
    size cannot be made, the rounds can."""
    files, warm = big
    path, digest = files[256]
    results = _memory(path, warm, "into", 2, {"as_limit": 128 * MIB, "memory_limit": 16 * MIB}, tmp_path,
                      env={"MALLOC_ARENA_MAX": "2"})
    for got in results:
        assert got.get("digest") == digest, got


def test_a_memory_limit_below_the_largest_tensor_fails_every_rank_naming_both(big, tmp_path):
    files, warm = big
    results = _memory(files[64][0], warm, "stream", 2, {"memory_limit": MIB}, tmp_path)
    for got in results:
        assert got.get("error") == "DistributedLoadError" and got["reason"] == "GroupReadFailed", got
        assert "memory_limit=1048576" in got["message"] and "2097152" in got["message"], got


def test_ranks_with_different_round_sizes_and_limits_agree_on_the_smallest(checkpoint, tmp_path):
    """A round size and a memory limit given on one rank only: the ranks use the smallest
    round any asked for, and both load every tensor."""
    root, sd = checkpoint
    for got in _ranks(str(root / "sharded"), tmp_path, mode="stream", framework="numpy",
                      opts={0: {"bucket_bytes": 4096}, 1: {"memory_limit": 150_000}}):
        assert got.get("tensors") == _digests(sd), got


def test_released_tensors_are_whole_when_handed_out(checkpoint, tmp_path):
    """With ``_release`` (tensor-parallel broadcast mode keeps its shards, not the block) the
    rounds' blocks are reused: each tensor's bytes were whole when handed out."""
    root, sd = checkpoint
    for got in _ranks(str(root / "sharded"), tmp_path, mode="release", opts={r: {"bucket_bytes": 8192} for r in (0, 1)}):
        assert got.get("tensors") == _digests(sd), got


@pytest.mark.parametrize("world", [2, 4])
def test_four_ranks_read_each_byte_of_an_s3_checkpoint_once(checkpoint, tmp_path, world):
    """The same files as an anonymous path-style S3 bucket (the test's Range server)."""
    root, sd = checkpoint
    tensor_bytes = sum(v.nbytes for v in sd.values())
    with serving(str(root)) as server:
        server.bulk()
        results = _ranks("s3://sharded/model.safetensors.index.json", tmp_path, world=world,
                         env={"GROUP_TEST_S3": server.url("").rstrip("/")})
        asked = server.tensor_bytes_asked()
    for got in results:
        assert got.get("tensors") == _digests(sd), got
    assert tensor_bytes <= asked <= 1.02 * tensor_bytes + 64 * world, (asked, tensor_bytes)


def test_spans_cover_the_block_once_in_equal_shares():
    for total, world in ((0, 3), (10, 3), (1 << 20, 7), (5, 8)):
        s = spans(total, world)
        assert s[0][0] == 0 and s[-1][1] == total and all(a[1] == b[0] for a, b in zip(s, s[1:], strict=False))
        assert max(b - a for a, b in s) - min(b - a for a, b in s) <= 1
