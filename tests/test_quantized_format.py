"""engine.quantize_file / load_quantized: quantized checkpoints, streamed one tensor at a time.

The int8 values and scales in the output are compared bit for bit with ``quantize_int8`` of
the source tensor (itself tested against the NumPy oracle in test_quantize.py) and with the
oracle directly; copied tensors byte for byte; the reference ``safetensors`` reads the output.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import warnings
import weakref

import ml_dtypes
import naive
import numpy as np
import pytest
from test_kernels import needs_jit

import engine
import engine.apps.quantized_format as qmod
from engine import SerializationError, open_checkpoint, save_file
from engine.apps.quantized_format import METADATA_KEY, QuantizeSummary, load_quantized, quantize_file
from engine.checkpoints.checkpoint import save_sharded
from engine.quantize import NonFiniteError, NonFiniteWarning, QuantizedTensor, dequantize_int8, quantize_int8
from engine.writing.writer import TensorWriter

BF16 = np.dtype(ml_dtypes.bfloat16)
H, KV, FF, V = 16, 8, 256, 32  # hidden, GQA kv width, MLP width (rows of 256: the fused path), vocab
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
SHAPES = {
    "self_attn.q_proj": (H, H),
    "self_attn.k_proj": (KV, H),
    "self_attn.v_proj": (KV, H),
    "self_attn.o_proj": (H, H),
    "mlp.gate_proj": (FF, H),
    "mlp.up_proj": (FF, H),
    "mlp.down_proj": (H, FF),
}


def llama(dtype, layers=2, seed=0) -> dict[str, np.ndarray]:
    """A tiny LLaMA-shaped state dict in ``dtype``, plus tensors that are never quantized."""
    rng = np.random.default_rng(seed)

    def w(shape):
        x = rng.standard_normal(shape) * rng.uniform(0.01, 3, shape[-1:])
        return x.astype(dtype)

    t = {"model.embed_tokens.weight": w((V, H))}
    for i in range(layers):
        p = f"model.layers.{i}."
        for lin in LINEAR:
            t[p + lin + ".weight"] = w(SHAPES[lin])
        t[p + "input_layernorm.weight"] = w((H,))
        t[p + "post_attention_layernorm.weight"] = w((H,))
    t["model.layers.0.self_attn.q_proj.weight"][3] = 0  # an all-zero row: scale 1
    t["model.norm.weight"] = w((H,))
    t["lm_head.weight"] = w((V, H))
    # never quantized: integer, bool, float64 and float8 tensors, 2-D included
    t["model.position_ids"] = np.arange(12, dtype=np.int64).reshape(3, 4)
    t["model.mask"] = rng.random((4, 4)) > 0.5
    t["model.extra_f64"] = rng.standard_normal((3, 5))
    t["model.extra_f8"] = rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn)
    return t


QUANTIZABLE = {"F32", "F16", "BF16"}


def default_selection(t: dict) -> set[str]:
    return {n for n, x in t.items() if x.dtype in (np.float32, np.float16, BF16) and x.ndim >= 2}


def raw(x) -> bytes:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).tobytes()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """One source file per dtype, written once for the whole module."""
    d = tmp_path_factory.mktemp("src")
    out = {}
    for dtype in (np.float32, BF16):
        t = llama(dtype)
        path = d / f"{np.dtype(dtype).name}.safetensors"
        save_file(t, path, {"format": "pt", "note": "tiny"}, fsync=False)
        out[np.dtype(dtype).name] = (path, t)
    return out


def check_output(dst, src_tensors, selected, axis, *, clamp=False):
    """Every quantized tensor equals quantize_int8 (and the oracle); the rest are byte copies."""
    with open_checkpoint(dst) as f:
        names = set(f.keys())
        expected = set(src_tensors) | {n + ".scale" for n in selected}
        assert names == expected
        record = json.loads(f.metadata()[METADATA_KEY])
        assert record["scheme"] == "int8-symmetric" and record["scale_suffix"] == ".scale"
        assert set(record["tensors"]) == selected
        for name, x in src_tensors.items():
            got = f.get_tensor(name)
            if name not in selected:
                info = f.info[name]
                assert info.dtype == engine.base.dtypes.NAMES[engine.base.dtypes.from_numpy(x.dtype)]
                assert got.shape == x.shape and raw(got) == raw(x), name
                continue
            ax = None if axis is None else axis % x.ndim
            assert record["tensors"][name] == {
                "dtype": engine.base.dtypes.NAMES[engine.base.dtypes.from_numpy(x.dtype)],
                "axis": ax,
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NonFiniteWarning)
                q0, s0 = quantize_int8(x, axis, on_nonfinite="clamp" if clamp else "raise")
            s = f.get_tensor(name + ".scale")
            assert got.dtype == np.int8 and got.shape == x.shape
            assert s.dtype == np.float32 and s.shape == (() if axis is None else (x.shape[axis],))
            assert np.array_equal(got, q0), name
            assert raw(s) == raw(s0), name
            if not clamp:
                qn, sn = naive.quantize_int8(x, axis)
                assert np.array_equal(got, qn) and raw(s) == raw(sn.reshape(s.shape)), name


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", [0, None, 1, -1])
def test_round_trip_bit_identical(model_files, tmp_path, dtype, axis):
    src, t = model_files[dtype]
    dst = tmp_path / "q.safetensors"
    summary = quantize_file(src, dst, axis=axis, fsync=False)
    selected = default_selection(t)
    assert isinstance(summary, QuantizeSummary)
    assert set(summary.quantized) == selected and set(summary.copied) == set(t) - selected
    assert summary.clamped == {}
    assert summary.path == os.fspath(dst)
    check_output(dst, t, selected, axis)

    header = engine.read_header(dst)
    assert summary.bytes_out == header.data_size
    assert summary.bytes_in == engine.read_header(src).data_size
    assert "quantized" in str(summary) and "copied" in str(summary)
    # the source's metadata is kept, the record appended
    meta = header.metadata
    assert meta["format"] == "pt" and meta["note"] == "tiny" and METADATA_KEY in meta


def test_reference_reads_output(model_files, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    src, t = model_files["bfloat16"]
    dst = tmp_path / "q.safetensors"
    quantize_file(src, dst, fsync=False)
    with safe_open(str(dst), framework="pt") as f, open_checkpoint(dst, framework="pt") as ours:
        assert sorted(f.keys()) == ours.keys()
        assert f.metadata() == ours.metadata()
        for name in f.keys():
            ref, got = f.get_tensor(name), ours.get_tensor(name)
            assert ref.dtype == got.dtype and ref.shape == got.shape
            assert torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))


def test_empty_and_f16_tensors(tmp_path):
    t = {
        "empty_rows": np.zeros((0, 4), np.float32),
        "empty_cols": np.zeros((3, 0), np.float16),
        "half": np.linspace(-2, 2, 12, dtype=np.float16).reshape(3, 4),
    }
    save_file(t, tmp_path / "s.safetensors", fsync=False)
    for axis in (0, 1, None):
        dst = tmp_path / f"q{axis}.safetensors"
        quantize_file(tmp_path / "s.safetensors", dst, axis=axis, fsync=False)
        check_output(dst, t, set(t), axis)


def test_sub_byte_tensor_copied(tmp_path):
    from engine.writing.writer import open_writer

    packed = np.arange(12, dtype=np.uint8).reshape(3, 4)
    with open_writer(
        tmp_path / "s.safetensors", [("f4", "F4", (3, 8)), ("w", "F32", (2, 2))], fsync=False
    ) as w:
        w.write("f4", packed)
        w.write("w", np.eye(2, dtype=np.float32))
    s = quantize_file(tmp_path / "s.safetensors", tmp_path / "q.safetensors", fsync=False)
    assert s.copied == ("f4",) and s.quantized == ("w",)
    h = engine.read_header(tmp_path / "q.safetensors")
    assert h["f4"].dtype == "F4" and h["f4"].shape == (3, 8)
    assert raw(open_checkpoint(tmp_path / "q.safetensors").get_tensor("f4")) == raw(packed)


def test_same_file_twice_is_deterministic(model_files, tmp_path):
    src, _ = model_files["float32"]
    quantize_file(src, tmp_path / "a.safetensors", fsync=False)
    quantize_file(src, tmp_path / "b.safetensors", fsync=False)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


# --------------------------------------------------------------------------- selection


def test_include_exclude(model_files, tmp_path):
    src, t = model_files["float32"]
    dst = tmp_path / "q.safetensors"

    s = quantize_file(src, dst, include="*.self_attn.*", exclude=["*.k_proj.*"], fsync=False)
    want = {n for n in t if ".self_attn." in n and ".k_proj." not in n}
    assert set(s.quantized) == want and len(want) == 6
    check_output(dst, t, want, 0)

    # exclude alone narrows the default; it wins over include
    s = quantize_file(src, dst, exclude=["lm_head.*", "model.embed_tokens.*"], fsync=False)
    assert set(s.quantized) == default_selection(t) - {"lm_head.weight", "model.embed_tokens.weight"}
    s = quantize_file(src, dst, include="lm_head.*", exclude="lm_head.*", fsync=False)
    assert s.quantized == ()
    assert json.loads(engine.read_header(dst).metadata[METADATA_KEY])["tensors"] == {}

    # include reaches 1-D tensors (one scale per element on axis 0); other dtypes stay copies
    s = quantize_file(src, dst, include=["*norm*", "model.position_ids", "model.extra_*"], fsync=False)
    norms = {n for n in t if "norm" in n}
    assert set(s.quantized) == norms
    check_output(dst, t, norms, 0)

    # patterns are case-sensitive and match whole names
    assert quantize_file(src, dst, include="LM_HEAD.*", fsync=False).quantized == ()
    assert quantize_file(src, dst, include="lm_head", fsync=False).quantized == ()


def test_bad_arguments(model_files, tmp_path):
    src, _ = model_files["float32"]
    dst = tmp_path / "q.safetensors"
    with pytest.raises(ValueError, match="on_nonfinite"):
        quantize_file(src, dst, on_nonfinite="ignore")
    with pytest.raises(TypeError):
        quantize_file(src, dst, axis=True)
    with pytest.raises(TypeError):
        quantize_file(src, dst, axis=0.0)
    with pytest.raises(TypeError):
        quantize_file(src, dst, include=[1])
    # axis 2 does not exist on the 2-D weights: refused before anything is written
    with pytest.raises(SerializationError) as ei:
        quantize_file(src, dst, axis=2)
    assert ei.value.reason == "InvalidAxis" and ei.value.tensors
    with pytest.raises(SerializationError, match="model.layers.0.input_layernorm.weight"):
        quantize_file(src, dst, axis=-2, include="*norm*")  # 1-D norms have no axis -2
    assert os.listdir(tmp_path) == []


def test_name_collision(tmp_path):
    t = {"w": np.ones((2, 3), np.float32), "w.scale": np.ones(2, np.float32)}
    save_file(t, tmp_path / "s.safetensors", fsync=False)
    with pytest.raises(SerializationError) as ei:
        quantize_file(tmp_path / "s.safetensors", tmp_path / "q.safetensors")
    assert ei.value.reason == "DuplicateKey" and ei.value.tensors == ("w.scale",)
    assert "w.scale" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == ["s.safetensors"]  # nothing written, no temp file
    # a 2-D "w.scale" is selected too: its own scales would be "w.scale.scale"; still a clash
    t["w.scale"] = np.ones((2, 1), np.float32)
    save_file(t, tmp_path / "s.safetensors", fsync=False)
    with pytest.raises(SerializationError, match="collide"):
        quantize_file(tmp_path / "s.safetensors", tmp_path / "q.safetensors")
    # excluding "w" removes the clash
    s = quantize_file(tmp_path / "s.safetensors", tmp_path / "q.safetensors", exclude="w", fsync=False)
    assert s.quantized == ("w.scale",)


def test_already_quantized_source(model_files, tmp_path):
    src, _ = model_files["float32"]
    quantize_file(src, tmp_path / "q.safetensors", fsync=False)
    with pytest.raises(SerializationError) as ei:
        quantize_file(tmp_path / "q.safetensors", tmp_path / "qq.safetensors")
    assert ei.value.reason == "AlreadyQuantized"
    assert not (tmp_path / "qq.safetensors").exists()


# --------------------------------------------------------------------------- sharded source


def test_sharded_source(tmp_path):
    t = llama(BF16, layers=3, seed=1)
    save_sharded(t, tmp_path / "sharded", max_shard_size=8000, metadata={"format": "pt"}, fsync=False)
    assert len(open_checkpoint(tmp_path / "sharded").shards) > 2
    save_file(t, tmp_path / "single.safetensors", {"format": "pt"}, fsync=False)

    single = tmp_path / "from_single.safetensors"
    quantize_file(tmp_path / "single.safetensors", single, fsync=False)
    for src in (tmp_path / "sharded", tmp_path / "sharded" / "model.safetensors.index.json"):
        dst = tmp_path / "from_sharded.safetensors"
        s = quantize_file(src, dst, fsync=False)
        assert set(s.quantized) == default_selection(t)
        check_output(dst, t, default_selection(t), 0)
        # same tensors, same shared metadata: the same file, byte for byte
        assert dst.read_bytes() == single.read_bytes()


def test_sharded_source_keeps_only_shared_metadata(tmp_path):
    d = tmp_path / "ckpt"
    save_sharded({"a": np.ones((2, 2), np.float32), "b": np.ones((4, 2), np.float32)}, d, max_shard_size=20, metadata={"format": "pt"}, fsync=False)  # fmt: skip
    # give one shard an extra key: only what every shard carries survives
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    with open_checkpoint(d / shard) as f:
        tensors = {n: np.array(f.get_tensor(n)) for n in f.keys()}
    save_file(tensors, d / shard, {"format": "pt", "only": "here"}, fsync=False)
    quantize_file(d, tmp_path / "q.safetensors", fsync=False)
    meta = engine.read_header(tmp_path / "q.safetensors").metadata
    assert set(meta) == {"format", METADATA_KEY}


# --------------------------------------------------------------------------- NaN / Inf


@pytest.fixture
def nan_file(tmp_path):
    t = llama(np.float32, layers=1)
    t["model.layers.0.mlp.up_proj.weight"][5, 2] = np.nan
    t["model.layers.0.mlp.up_proj.weight"][7, 1] = np.inf
    t["model.layers.0.self_attn.o_proj.weight"][0, 0] = -np.inf
    path = tmp_path / "nan.safetensors"
    save_file(t, path, fsync=False)
    return path, t


def test_nonfinite_raise_leaves_nothing(nan_file, tmp_path):
    src, _ = nan_file
    dst = tmp_path / "out" / "q.safetensors"
    dst.parent.mkdir()
    with pytest.raises(NonFiniteError) as ei:
        quantize_file(src, dst)
    err = ei.value
    # the first bad tensor in file order (sorted by name within a dtype: mlp before self_attn)
    assert err.tensors == ("model.layers.0.mlp.up_proj.weight",)
    assert err.path == os.fspath(src) and os.fspath(src) in str(err) and err.tensors[0] in str(err)
    assert (err.nan_count, err.posinf_count, err.neginf_count) == (1, 1, 0)
    assert os.listdir(dst.parent) == []  # no dst, no temporary file

    # a previous dst stays intact
    dst.write_bytes(b"previous")
    with pytest.raises(NonFiniteError):
        quantize_file(src, dst, fsync=False)
    assert dst.read_bytes() == b"previous" and os.listdir(dst.parent) == ["q.safetensors"]


def test_nonfinite_clamp(nan_file, tmp_path):
    src, t = nan_file
    dst = tmp_path / "q.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the summary reports clamping, not a warning
        s = quantize_file(src, dst, on_nonfinite="clamp", fsync=False)
    assert s.clamped == {
        "model.layers.0.self_attn.o_proj.weight": (0, 0, 1),
        "model.layers.0.mlp.up_proj.weight": (1, 1, 0),
    }
    assert "clamped NaN/Inf in 2" in str(s)
    check_output(dst, t, default_selection(t), 0, clamp=True)
    q = open_checkpoint(dst).get_tensor("model.layers.0.mlp.up_proj.weight")
    assert q[5, 2] == 0 and q[7, 1] == 127


def test_nan_in_a_copied_tensor_is_fine(tmp_path):
    t = {"w": np.ones((2, 2), np.float32), "norm": np.array([np.nan, 1], np.float32)}
    save_file(t, tmp_path / "s.safetensors", fsync=False)
    s = quantize_file(tmp_path / "s.safetensors", tmp_path / "q.safetensors", fsync=False)
    assert s.copied == ("norm",)


# --------------------------------------------------------------------------- load_quantized


@pytest.fixture(scope="module")
def quantized(model_files, tmp_path_factory):
    """(path, source tensors, axis) for a BF16 file quantized per row and one per tensor."""
    d = tmp_path_factory.mktemp("q")
    src, t = model_files["bfloat16"]
    out = {}
    for axis in (0, None):
        path = d / f"q{axis}.safetensors"
        quantize_file(src, path, axis=axis, exclude="lm_head.*", fsync=False)
        out[axis] = path
    return out, t


@pytest.mark.parametrize("axis", [0, None])
def test_load_quantized_numpy(quantized, axis):
    paths, t = quantized
    got = load_quantized(paths[axis])
    assert set(got) == set(t)  # no ".scale" entries at the top level
    selected = default_selection(t) - {"lm_head.weight"}
    for name, x in t.items():
        v = got[name]
        if name not in selected:
            assert isinstance(v, np.ndarray) and raw(v) == raw(x)
            continue
        assert isinstance(v, QuantizedTensor)
        q0, s0 = quantize_int8(x, axis)
        assert v.axis == axis and v.dtype == "BF16"
        assert np.array_equal(v.q, q0) and raw(v.scale) == raw(s0)
        back = v.dequantize()
        assert back.dtype == BF16 and raw(back) == raw(dequantize_int8(q0, s0, axis, BF16))

    deq = load_quantized(paths[axis], dequantize=True)
    assert set(deq) == set(t)
    for name in selected:
        q0, s0 = quantize_int8(t[name], axis)
        assert deq[name].dtype == BF16
        assert raw(deq[name]) == raw(naive.dequantize_int8(q0, s0, axis, BF16))
    f32 = load_quantized(paths[axis], dequantize=True, dtype="F32")
    f16 = load_quantized(paths[axis], dequantize=True, dtype=np.float16)
    name = "model.layers.1.mlp.down_proj.weight"
    q0, s0 = quantize_int8(t[name], axis)
    assert raw(f32[name]) == raw(naive.dequantize_int8(q0, s0, axis, np.float32))
    assert f16[name].dtype == np.float16
    assert raw(f32["lm_head.weight"]) == raw(t["lm_head.weight"])  # untouched tensors stay as stored


def test_load_quantized_torch(quantized):
    torch = pytest.importorskip("torch")
    paths, t = quantized
    got = load_quantized(paths[0], framework="pt")
    name = "model.layers.0.self_attn.q_proj.weight"
    v = got[name]
    assert isinstance(v, QuantizedTensor) and v.q.dtype == torch.int8 and v.scale.dtype == torch.float32
    q0, s0 = quantize_int8(t[name], 0)
    assert np.array_equal(v.q.numpy(), q0) and np.array_equal(v.scale.numpy(), s0)
    assert got["model.norm.weight"].dtype == torch.bfloat16

    deq = load_quantized(paths[0], dequantize=True, framework="pt")
    assert deq[name].dtype == torch.bfloat16
    want = naive.dequantize_int8(q0, s0, 0, BF16)
    assert np.array_equal(deq[name].view(torch.int16).numpy(), want.view(np.int16))
    deq32 = load_quantized(paths[0], dequantize=True, framework="pt", dtype=torch.float32)
    assert deq32[name].dtype == torch.float32
    assert np.array_equal(deq32[name].numpy(), naive.dequantize_int8(q0, s0, 0, np.float32))


def test_load_quantized_bad_dtype(quantized):
    paths, _ = quantized
    for dtype in ("I8", "F64", np.float64):
        with pytest.raises(TypeError):
            load_quantized(paths[0], dequantize=True, dtype=dtype)


def _record(**over):
    rec = {
        "scheme": "int8-symmetric",
        "scale_suffix": ".scale",
        "tensors": {"w": {"dtype": "BF16", "axis": 0}},
    }
    rec.update(over)
    return json.dumps(rec)


@pytest.mark.parametrize(
    "tensors, meta, match",
    [
        ({"w": np.zeros((2, 3), np.int8)}, None, "no 'engine.quantization'"),
        ({"w": np.zeros((2, 3), np.int8)}, {"format": "pt"}, "no 'engine.quantization'"),
        ({}, {METADATA_KEY: "{not json"}, "not valid JSON"),
        ({}, {METADATA_KEY: "[]"}, "scheme"),
        ({}, {METADATA_KEY: _record(scheme="int4")}, "scheme"),
        ({}, {METADATA_KEY: _record(scale_suffix="")}, "scale_suffix"),
        ({}, {METADATA_KEY: _record(tensors=[])}, "tensors must be an object"),
        ({}, {METADATA_KEY: _record(tensors={"w": {"dtype": "F64", "axis": 0}})}, "dtype F32"),
        ({}, {METADATA_KEY: _record(tensors={"w": {"dtype": "BF16", "axis": -1}})}, "axis null"),
        ({}, {METADATA_KEY: _record(tensors={"w": {"dtype": "BF16", "axis": True}})}, "axis null"),
        ({}, {METADATA_KEY: _record(tensors={"w": "BF16"})}, "needs dtype"),
        ({"w": np.zeros((2, 3), np.int8)}, {METADATA_KEY: _record()}, "no tensor 'w.scale'"),
        ({"w.scale": np.ones(2, np.float32)}, {METADATA_KEY: _record()}, "no tensor 'w'"),
        ({"w": np.zeros((2, 3), np.int8), "w.scale": np.ones(3, np.float32)}, {METADATA_KEY: _record()}, "F32\\[2\\]"),
        ({"w": np.zeros((2, 3), np.int16), "w.scale": np.ones(2, np.float32)}, {METADATA_KEY: _record()}, "I8"),
        ({"w": np.zeros((2, 3), np.int8), "w.scale": np.ones(2, np.float16)}, {METADATA_KEY: _record()}, "I8"),
        ({"w": np.zeros((2, 3), np.int8), "w.scale": np.ones(2, np.float32)}, {METADATA_KEY: _record(tensors={"w": {"dtype": "F32", "axis": 2}})}, "axis 2"),
        ({"w": np.zeros((2, 3), np.int8), "w.scale": np.ones(2, np.float32)}, {METADATA_KEY: _record(tensors={"w": {"dtype": "F32", "axis": None}})}, "F32\\[\\]"),
    ],
)  # fmt: skip
def test_load_quantized_malformed(tmp_path, tensors, meta, match):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, path, meta, fsync=False)
    with pytest.raises(SerializationError, match=match) as ei:
        load_quantized(path)
    assert ei.value.reason == "InvalidQuantization" and ei.value.path == os.fspath(path)


def test_load_quantized_valid_hand_written(tmp_path):
    # the convention is all a reader needs: a file made by hand loads
    q = np.array([[127, -127, 0], [0, 0, 0]], np.int8)
    s = np.array([0.5, 1.0], np.float32)
    save_file({"w": q, "w.scale": s}, tmp_path / "h.safetensors", {METADATA_KEY: _record()}, fsync=False)
    got = load_quantized(tmp_path / "h.safetensors", dequantize=True, dtype="F32")
    assert np.array_equal(got["w"], [[63.5, -63.5, 0], [0, 0, 0]])


# --------------------------------------------------------------------------- memory


def test_one_tensor_at_a_time(model_files, tmp_path, monkeypatch):
    """Each tensor is quantized, then both its parts written, before the next is quantized,
    and no earlier int8 output is still alive when the next one is made."""
    src, t = model_files["float32"]
    events: list[tuple[str, str]] = []
    alive: list[weakref.ref] = []
    real_quantize, real_write = qmod.quantize_array, TensorWriter.write

    def spy_quantize(a, kind, axis, raise_nonfinite, name, *args, **kw):
        leaked = [r() for r in alive if r() is not None]
        assert not leaked, f"{len(leaked)} earlier outputs still alive when quantizing {name!r}"
        q, scale, bad = real_quantize(a, kind, axis, raise_nonfinite, name, *args, **kw)
        alive.extend((weakref.ref(q), weakref.ref(scale)))
        events.append(("quantize", name))
        return q, scale, bad

    def spy_write(self, name, data):
        events.append(("write", name))
        return real_write(self, name, data)

    monkeypatch.setattr(qmod, "quantize_array", spy_quantize)
    monkeypatch.setattr(TensorWriter, "write", spy_write)
    s = quantize_file(src, tmp_path / "q.safetensors", fsync=False)

    selected = default_selection(t)
    assert len(s.quantized) == len(selected) > 10
    expected = []
    for name in open_checkpoint(src).offset_keys():  # source (file) order
        if name in selected:
            expected += [("quantize", name), ("write", name), ("write", name + ".scale")]
        else:
            expected.append(("write", name))
    assert events == expected


@needs_jit  # interpreted kernels allocate their scratch through numpy: tracemalloc would see it
def test_peak_memory_is_one_tensor(tmp_path):
    """tracemalloc sees every numpy allocation: the peak is about the largest int8 output,
    not the model's (mapped source tensors are not allocations)."""
    rng = np.random.default_rng(0)
    n, shape = 12, (64, 1024)
    t = {f"layer.{i}.weight": rng.standard_normal(shape).astype(np.float32) for i in range(n)}
    src = tmp_path / "s.safetensors"
    save_file(t, src, fsync=False)
    del t
    quantize_file(src, tmp_path / "warm.safetensors", fsync=False)  # compile, import
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        quantize_file(src, tmp_path / "q.safetensors", fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one = 64 * 1024  # one int8 output; the whole model's would be 12 times that
    assert peak < one + (96 << 10), peak


# --------------------------------------------------------------------------- cli


def test_cli_quantize(model_files, tmp_path, capsys):
    from engine.commands.cli import main

    src, t = model_files["float32"]
    assert main(["quantize", str(src), str(tmp_path / "q.safetensors")]) == 0
    out = capsys.readouterr().out
    assert f"quantized {len(default_selection(t))} tensors" in out and "wrote" in out
    check_output(tmp_path / "q.safetensors", t, default_selection(t), 0)


def test_lazy_exports():
    assert engine.quantize_file is quantize_file and engine.load_quantized is load_quantized
