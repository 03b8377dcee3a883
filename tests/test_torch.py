"""engine.torch: one storage per tensor on every load path, and the reference's torch API."""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="engine.torch needs torch (the torch extra)")

import safetensors.torch as ref  # noqa: E402

import engine  # noqa: E402
import engine.torch as et  # noqa: E402
from engine.sinks.torch import own_storage  # noqa: E402
from engine.torch import deduplicate  # noqa: E402


def _state(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {f"layers.{i}.weight": torch.randn(16, 8, generator=g) for i in range(n)}
    out["norm.weight"] = torch.randn(8, generator=g).to(torch.bfloat16)
    out["empty"] = torch.empty(0, 4)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    out["ids"] = torch.arange(5, dtype=torch.int64)
    return out


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.safetensors"
    state = _state()
    ref.save_file(state, path)
    return path, state


def _paths(path):
    """Every way the engine hands out torch tensors on the CPU."""
    yield "load_file mmap", et.load_file(path)
    yield "load_file pread", et.load_file(path, backend="pread")
    yield "load(bytes)", et.load(path.read_bytes())
    yield "stream", dict(engine.stream(path, framework="pt", device="cpu"))
    with engine.safe_open(path, framework="pt") as f:
        yield "safe_open get_tensor", {k: f.get_tensor(k) for k in f.keys()}
        yield "safe_open get_tensors", f.get_tensors()
    with engine.safe_open(path, framework="pt", backend="pread") as f:
        yield "safe_open pread get_tensor", {k: f.get_tensor(k) for k in f.keys()}
    yield "checkpoint", engine.open_checkpoint(path.parent, framework="pt").get_tensors()


def test_every_tensor_has_its_own_storage(model_file):
    path, state = model_file
    for label, loaded in _paths(path):
        assert set(loaded) == set(state), label
        for name, t in loaded.items():
            assert torch.equal(t, state[name]), (label, name)
            if t.numel():
                storage = t.untyped_storage()
                assert storage.nbytes() == t.nbytes, (label, name, storage.nbytes())
                assert storage.data_ptr() == t.data_ptr(), (label, name)
        # the reference's own sharing check (and so accelerate's and transformers') sees no sharing
        assert all(len(group) == 1 for group in ref._find_shared_tensors(loaded)), label
        assert et._find_shared_tensors(loaded) == ref._find_shared_tensors(loaded), label


def test_storage_aware_savers_round_trip_every_tensor(model_file, tmp_path):
    """A model filled from each path and saved by the reference's save_model (which drops
    tensors it finds sharing a storage, as accelerate does) gets every tensor back."""
    path, state = model_file
    names = [k for k in state if k.startswith("layers.")]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 16, bias=False) for _ in names)

    for label, loaded in _paths(path):
        model = Model()
        with torch.no_grad():
            for i, layer in enumerate(model.layers):
                layer.weight = torch.nn.Parameter(loaded[f"layers.{i}.weight"])
        out = tmp_path / "saved.safetensors"
        ref.save_model(model, str(out))
        back = ref.load_file(out)
        assert set(back) == set(model.state_dict()), label
        for name in back:
            assert torch.equal(back[name], state[name]), (label, name)


def test_torch_save_of_one_tensor_writes_only_its_bytes(model_file, tmp_path):
    path, state = model_file
    for label, loaded in _paths(path):
        buf = io.BytesIO()
        torch.save(loaded["ids"], buf)
        assert len(buf.getvalue()) < 40 * 1024 and state["ids"].nbytes < 1024, label
        back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert torch.equal(back, state["ids"]), label


def test_memory_lives_until_the_last_tensor_goes(model_file):
    path, state = model_file
    for backend in ("mmap", "pread"):
        with engine.safe_open(path, framework="pt", backend=backend) as f:
            kept = f.get_tensors()["layers.3.weight"]
        gc.collect()
        assert torch.equal(kept, state["layers.3.weight"])
        kept += 1  # writable, private: the file is unchanged
    assert torch.equal(ref.load_file(path)["layers.3.weight"], state["layers.3.weight"])


def test_own_storage_over_one_allocation():
    """The device path's mechanism, checked on the CPU: a slice of one allocation becomes a
    tensor whose storage is exactly its bytes and which keeps the allocation alive."""
    block = torch.arange(1024, dtype=torch.uint8)
    t = own_storage(block[256:512])
    assert t.untyped_storage().nbytes() == 256
    assert t.untyped_storage().data_ptr() == block.data_ptr() + 256
    as_f32 = t.view(torch.float32).view(8, 8)
    assert as_f32.untyped_storage().nbytes() == 256
    del block
    gc.collect()
    assert t.tolist() == [(256 + i) % 256 for i in range(256)]


def test_device_destinations_are_the_caching_allocators_own_unless_shared():
    """record_stream records only on storages torch's allocator made (on a CUDA device, its
    caching allocator): the default destinations are such storages, each over its tensor's
    bytes; the one block of per_tensor=False hands out storages it did not make (not
    resizable), which is why that layout is opt-in.  The device played by the CPU."""
    from engine.base import dtypes
    from engine.sinks.torch import allocate_device

    specs = [(0, dtypes.BY_NAME["F32"].code, [4, 4], 64), (1, dtypes.BY_NAME["I8"].code, [3], 3),
             (2, dtypes.BY_NAME["BF16"].code, [0], 0)]
    cpu = torch.device("cpu")
    tensors, targets = allocate_device(specs, cpu)
    assert [tuple(tensors[r].shape) for r in range(3)] == [(4, 4), (3,), (0,)]
    assert tensors[2].dtype == torch.bfloat16
    for row in (0, 1):
        storage = tensors[row].untyped_storage()
        assert storage.resizable() and storage.nbytes() == tensors[row].nbytes, row
        assert targets[row].data_ptr() == tensors[row].data_ptr() and targets[row].dtype == torch.uint8
    assert tensors[0].data_ptr() != tensors[1].data_ptr()
    shared, _ = allocate_device(specs, cpu, per_tensor=False)
    assert not any(shared[r].untyped_storage().resizable() for r in (0, 1))


def test_the_fence_recorded_again_on_another_thread_still_follows_the_consumers_stream(monkeypatch):
    """``stream``'s windows run on a worker thread whose current stream is not the consumer's:
    the fence recorded again there must first wait for its record on the consumer's stream,
    or the next window's copies stop waiting for the work queued there before the load (a
    freed block's last readers).  torch's CUDA streams and events are stood in for by ones
    that log what is asked of them, each thread with a current stream of its own."""
    import threading

    from engine.sinks.torch import TorchCudaOps

    log: list[tuple] = []
    current = threading.local()

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event) -> None:
            log.append(("wait", self.name, event.where))

    class Event:
        where = None

        def record(self, stream) -> None:
            self.where = stream.name
            log.append(("record", stream.name))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(current, "stream", Stream("S")))
    ops = TorchCudaOps(torch.device("cuda", 0))  # made on the consumer's thread: its stream S

    def worker() -> None:
        current.stream = Stream("C")
        ops.fence_again()  # after window 1
        ops.fence_again()  # after window 2

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert log == [("record", "S"), ("wait", "C", "S"), ("record", "C"), ("wait", "C", "C"), ("record", "C")], log


def test_load_to_other_torch_devices(model_file):
    """Devices other than cpu and cuda get the tensors through .to(), as the reference does."""
    path, state = model_file
    loaded = et.load_file(path, device="meta")
    assert all(t.device.type == "meta" for t in loaded.values())
    assert {k: tuple(t.shape) for k, t in loaded.items()} == {k: tuple(t.shape) for k, t in state.items()}
    with engine.safe_open(path, framework="pt", device="meta") as f:
        assert f.get_slice("layers.0.weight")[:2].device.type == "meta"


def test_float4_comes_back_as_torch_dtype(tmp_path):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch build has no float4_e2m1fn_x2")
    x = torch.randint(0, 255, (4, 6), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    ref.save_file({"x": x}, path)
    for loaded in (et.load_file(path), et.load_file(path, backend="pread")):
        assert loaded["x"].dtype == torch.float4_e2m1fn_x2 and loaded["x"].shape == x.shape
        assert torch.equal(loaded["x"].view(torch.uint8), x.view(torch.uint8))
    et.save_file({"x": x}, tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == path.read_bytes()


# -- the reference's helpers ------------------------------------------------------------------


def test_find_shared_tensors_matches_the_reference():
    a = torch.zeros(4, 4)
    cases = [
        {"A": a, "B": a[:1]},
        {"B": a[:2].reshape(-1), "C": a[2:].reshape(-1)},
        {"B": a[:2], "C": a[1:], "D": torch.zeros(3)},
        {"M": torch.zeros(2, device="meta"), "E": torch.empty(0)},
        {"x": a, "y": a, "z": a[1]},
    ]
    for case in cases:
        assert et._find_shared_tensors(case) == ref._find_shared_tensors(case)
        try:
            expected = ref._remove_duplicate_names(case)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                et._remove_duplicate_names(case)
        else:
            assert et._remove_duplicate_names(case) == expected
    for t in (a, a[1], a[:, 1], torch.zeros(0), torch.zeros(5, dtype=torch.float16)[::3]):
        assert et._end_ptr(t) == ref._end_ptr(t)
        assert (et.storage_ptr(t), et.storage_size(t)) == (ref.storage_ptr(t), ref.storage_size(t))
    # where the reference's view(-1) fails, ours still says where the last element ends
    assert et._end_ptr(a[::2]) == a.data_ptr() + (2 * 4 + 3 + 1) * 4
    assert et._end_ptr(a.t()) == a.data_ptr() + 16 * 4


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied


def test_save_model_and_load_model_like_the_reference(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    et.save_model(model, ours)
    ref.save_model(model, str(theirs))
    with engine.safe_open(ours, framework="pt") as f, ref.safe_open(theirs, framework="pt") as g:
        assert f.metadata() == g.metadata() and sorted(f.keys()) == sorted(g.keys())
    fresh = _Tied()
    missing, unexpected = et.load_model(fresh, ours)
    assert (set(missing), list(unexpected)) == (set(), [])
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    # strict: a key the model lacks
    extra = tmp_path / "extra.safetensors"
    et.save_file({**{k: v.clone() for k, v in ref.load_file(ours).items()}, "c.weight": torch.zeros(1)}, extra)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        et.load_model(_Tied(), extra)
    missing, unexpected = et.load_model(_Tied(), extra, strict=False)
    assert unexpected == ["c.weight"] and not missing


def test_shared_tensors_raise_runtime_error(tmp_path):
    a = torch.zeros(4)
    with pytest.raises(RuntimeError) as info:
        et.save_file({"x": a, "y": a}, tmp_path / "x.safetensors")
    assert isinstance(info.value, engine.SharedTensorsError) and isinstance(info.value, engine.SerializationError)
    assert set(info.value.tensors) == {"x", "y"}
    with pytest.raises(RuntimeError, match="meta"):
        et.save_file({"m": torch.zeros(2, device="meta")}, tmp_path / "m.safetensors")
    # numpy arrays have no storages: the same array under two names is written twice, as the reference does
    arr = np.zeros(3, np.float32)
    assert engine.save({"a": arr, "b": arr}) == __import__("safetensors.numpy").numpy.save({"a": arr, "b": arr})


def test_save_model_non_contiguous(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 6).t())

    with pytest.raises(ValueError, match=r"force_contiguous=True"):
        et.save_model(M(), tmp_path / "m.safetensors", force_contiguous=False)
    m = M()
    et.save_model(m, tmp_path / "m.safetensors")
    assert torch.equal(et.load_file(tmp_path / "m.safetensors")["w"], m.w.detach())


def test_deduplicate_rules():
    base = torch.randn(8, 4)
    sd = {"b": base, "a": base, "c": base.view(8, 4), "half": base[4:], "t": base.t(), "other": torch.zeros(3)}
    out, aliases, copied = deduplicate(sd)
    assert aliases == {"b": "a", "c": "a"}  # identical views: the first name in sorted order kept
    assert set(out) == {"a", "half", "t", "other"} and list(out) == ["a", "half", "t", "other"]
    assert sorted(copied) == ["half", "t"]
    assert out["half"].data_ptr() != base.data_ptr() + 16 * 4 and torch.equal(out["half"], base[4:])
    assert out["t"].is_contiguous() and torch.equal(out["t"], base.t())
    assert out["a"] is base
    # a view that is the only name for its storage, but not all of it, is simply kept
    out, aliases, copied = deduplicate({"x": torch.randn(10)[2:5]})
    assert aliases == {} and copied == []




@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_load_file_of_a_sharded_checkpoint(tmp_path, backend):
    # a directory or an index loads as one; every tensor keeps its own storage across shards
    state = _state(12)
    split = engine.save_sharded(state, tmp_path / "ckpt", max_shard_size="1KB")
    assert len(split.filename_to_tensors) > 2
    for where in (tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors.index.json"):
        loaded = et.load_file(where, backend=backend)
        assert set(loaded) == set(state)
        for name, t in loaded.items():
            assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name
            if t.numel():
                assert t.untyped_storage().nbytes() == t.nbytes, name
        assert all(len(group) == 1 for group in ref._find_shared_tensors(loaded))


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_every_byte_sized_dtype_and_rank_gets_its_own_exact_storage(tmp_path, backend):
    # dtypes numpy has (one tensor from the array) and those it lacks (BF16, FP8: viewed)
    from engine.base import dtypes

    g = torch.Generator().manual_seed(1)
    state = {}
    for d in dtypes.DTYPES:
        if d.sub_byte:
            continue
        try:
            tdt = dtypes.torch_dtype(d.code)
        except engine.SafetensorError:
            continue
        for shape in [(), (5,), (3, 4), (2, 3, 4)]:
            raw = torch.randint(0, 256, (max(1, int(np.prod(shape))) * d.itemsize,), dtype=torch.uint8, generator=g)
            if tdt == torch.bool:
                raw = raw % 2
            state[f"{d.name}.{len(shape)}"] = raw.view(tdt).reshape(shape)
    path = tmp_path / "all.safetensors"
    et.save_file(state, path)
    loaded = et.load_file(path, backend=backend)
    for name, t in state.items():
        got = loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        assert got.untyped_storage().nbytes() == t.nbytes and got.untyped_storage().data_ptr() == got.data_ptr(), name
