"""Sharded checkpoints: engine.checkpoints.checkpoint (open_checkpoint, save_sharded, the index rules)."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
import engine.checkpoints.checkpoint_info
import engine.numpy
from engine.checkpoints import checkpoint as ck
from engine.checkpoints.checkpoint import (
    CheckpointIndexError,
    CheckpointInfo,
    MissingShardError,
    check_checkpoint,
    open_checkpoint,
    parse_index,
    parse_size,
    read_checkpoint_info,
    save_sharded,
    split_into_shards,
)
from engine.errors import HeaderError, SafetensorError, SerializationError, TensorNotFoundError, WriteError


def arrays(n=12, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        out[f"model.layers.{i}.weight"] = rng.standard_normal((16, 8 + i)).astype(np.float32)
        out[f"model.layers.{i}.bias"] = rng.standard_normal(8 + i).astype(ml_dtypes.bfloat16)
    out["lm_head.weight"] = rng.standard_normal((64, 64)).astype(np.float16)
    out["empty"] = np.zeros((0, 3), np.int32)
    return out


def listing(path):
    return sorted(p for p in os.listdir(path))


@pytest.fixture
def sharded(tmp_path):
    sd = arrays()
    split = save_sharded(sd, tmp_path / "ckpt", max_shard_size="2KB", metadata={"format": "np"})
    assert split.is_sharded
    return tmp_path / "ckpt", sd, split


# --------------------------------------------------------------------------- round trips


def test_what_safe_open_returns_is_a_safe_open(sharded):
    """engine.safe_open opens a file or a checkpoint; either way the result is an instance of it."""
    path, sd, split = sharded
    for where in (path, path / "model.safetensors.index.json", path / sorted(split.filename_to_tensors)[0]):
        with engine.safe_open(where, framework="np") as f:
            assert isinstance(f, engine.safe_open), type(f)
            assert issubclass(type(f), engine.safe_open)
            assert f.keys()
    assert not isinstance(object(), engine.safe_open) and not issubclass(dict, engine.safe_open)
    assert issubclass(engine.safe_open, engine.loading.file_handle.safe_open)  # subclassing keeps working


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_numpy_round_trip(sharded, backend):
    path, sd, split = sharded
    for where in (path, path / "model.safetensors.index.json"):
        with open_checkpoint(where, backend=backend) as c:
            assert c.keys() == sorted(sd)
            assert len(c) == len(sd) and "lm_head.weight" in c
            assert c.shards == sorted(split.filename_to_tensors)
            assert c.metadata() == {"format": "np"}
            assert c.index_metadata == {"total_size": sum(a.nbytes for a in sd.values())}
            loaded = c.get_tensors()
            assert loaded.keys() == sd.keys()
            for name, a in sd.items():
                np.testing.assert_array_equal(loaded[name], a)
                assert loaded[name].dtype == a.dtype
            np.testing.assert_array_equal(c.get_tensor("model.layers.3.weight"), sd["model.layers.3.weight"])
            np.testing.assert_array_equal(
                c.get_slice("lm_head.weight")[3:9, ::-2], sd["lm_head.weight"][3:9, ::-2]
            )
            sub = c.get_tensors(["lm_head.weight", "model.layers.0.bias"])
            assert list(sub) == ["lm_head.weight", "model.layers.0.bias"]
            assert c.offset_keys()[0] in split.filename_to_tensors[c.shards[0]]


def test_torch_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    sd = {f"w{i}": torch.randn(10, i + 1, dtype=torch.bfloat16) for i in range(10)}
    sd["i"] = torch.arange(100)
    save_sharded(sd, tmp_path, max_shard_size=600, metadata={"format": "pt"})
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    for backend in ("mmap", "pread"):
        with open_checkpoint(tmp_path, framework="pt", backend=backend) as c:
            out = c.get_tensors()
            assert all(torch.equal(out[k], v) for k, v in sd.items())
            assert torch.equal(c.get_slice("i")[5:10], sd["i"][5:10])


def test_single_shard_is_model_safetensors_without_index(tmp_path):
    sd = arrays(2)
    split = save_sharded(sd, tmp_path, metadata={"format": "np"})
    assert listing(tmp_path) == ["model.safetensors"]
    assert not split.is_sharded and list(split.filename_to_tensors) == ["model.safetensors"]
    for where in (tmp_path, tmp_path / "model.safetensors"):
        with open_checkpoint(where) as c:
            assert c.shards == ["model.safetensors"] and c.index_metadata is None
            np.testing.assert_array_equal(c.get_tensor("empty"), sd["empty"])
    # the same bytes as save_file
    assert (tmp_path / "model.safetensors").read_bytes() == engine.numpy.save(sd, metadata={"format": "np"})


def test_reference_safetensors_reads_every_shard(sharded):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path, sd, split = sharded
    for shard, names in split.filename_to_tensors.items():
        got = safetensors_numpy.load_file(str(path / shard))
        assert sorted(got) == sorted(names)
        for name in names:
            if sd[name].dtype != ml_dtypes.bfloat16:  # the reference's numpy API has no bf16
                np.testing.assert_array_equal(got[name], sd[name])
    from safetensors import safe_open as ref_open

    for shard, names in split.filename_to_tensors.items():
        with ref_open(str(path / shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(names) and f.metadata() == {"format": "np"}


def test_info_and_parameters(sharded):
    path, sd, _ = sharded
    info = read_checkpoint_info(path)
    assert info.is_sharded and info.keys() == sorted(sd)
    params = info.parameters()
    assert params["total"] == sum(a.size for a in sd.values())
    assert list(params) == ["F16", "BF16", "I32", "F32", "total"]  # dtype-code order, as Header.parameters
    assert info.nbytes == sum(a.nbytes for a in sd.values())
    assert info["lm_head.weight"].shape == (64, 64)
    assert len(info.tensors()) == len(sd)
    with pytest.raises(TensorNotFoundError, match="did you mean 'lm_head.weight'"):
        info["lm_head.weights"]
    doc = info.to_dict()
    assert set(doc) == {"metadata", "weight_map", "shards"}


def test_shard_path_is_where_the_shard_lies(sharded, tmp_path):
    path, _, split = sharded
    for where in (path, path / "model.safetensors.index.json"):
        with open_checkpoint(where) as c:
            for info in (read_checkpoint_info(where), c.info):
                assert info.directory == str(path)
                for shard in split.filename_to_tensors:
                    assert info.shard_path(shard) == os.path.join(str(path), shard)
                    assert os.path.isfile(info.shard_path(shard))
                with pytest.raises(KeyError):
                    info.shard_path("absent.safetensors")
    engine.numpy.save_file({"a": np.zeros(2)}, tmp_path / "one.safetensors")
    assert read_checkpoint_info(tmp_path / "one.safetensors").shard_path("one.safetensors") == str(
        tmp_path / "one.safetensors")
    # a remote checkpoint's shards have no local path
    remote = CheckpointInfo("https://example.invalid/m.safetensors", {"m.safetensors": engine.read_header(
        tmp_path / "one.safetensors")})
    with pytest.raises(ValueError, match="not a local checkpoint"):
        remote.shard_path("m.safetensors")


def test_unknown_tensor(sharded):
    path, _, _ = sharded
    with open_checkpoint(path) as c:
        with pytest.raises(TensorNotFoundError) as e:
            c.get_tensor("nope")
        assert isinstance(e.value, KeyError)


# --------------------------------------------------------------------------- Hugging Face layout


def test_matches_huggingface_hub(tmp_path):
    torch = pytest.importorskip("torch")
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    sd = {f"h.{i}.w": torch.randn(50 + 17 * i) for i in range(25)}
    sd["huge"] = torch.randn(2000)  # larger than a shard: a shard of its own
    hf_dir, our_dir = tmp_path / "hf", tmp_path / "ours"
    hf_dir.mkdir()
    hub.save_torch_state_dict(sd, hf_dir, max_shard_size="1KB")
    split = save_sharded(sd, our_dir, max_shard_size="1KB", metadata={"format": "pt"})
    assert listing(hf_dir) == listing(our_dir)
    for name in listing(hf_dir):
        if name.endswith(".safetensors"):
            assert (hf_dir / name).read_bytes() == (our_dir / name).read_bytes(), name
    index = "model.safetensors.index.json"
    assert json.loads((hf_dir / index).read_text()) == json.loads((our_dir / index).read_text())
    theirs = hub.split_torch_state_dict_into_shards(sd, max_shard_size="1KB")
    assert split.filename_to_tensors == theirs.filename_to_tensors
    assert split.tensor_to_filename == theirs.tensor_to_filename
    assert split.metadata == theirs.metadata
    assert (our_dir / index).read_bytes() == (hf_dir / index).read_bytes()  # the text too (test_shards)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=0, max_size=30),
    limit=st.integers(1, 4000),
)
def test_split_matches_huggingface_hub_factory(sizes, limit):
    base = pytest.importorskip("huggingface_hub.serialization._base")
    named = {f"t{i}": s for i, s in enumerate(sizes)}
    ours = split_into_shards(named, limit)
    if not sizes:  # the hub returns no file at all; we write one empty model.safetensors
        assert ours.filename_to_tensors == {"model.safetensors": []}
        return
    theirs = base.split_state_dict_into_shards_factory(
        named, get_storage_size=lambda s: s, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    assert ours.filename_to_tensors == theirs.filename_to_tensors
    assert ours.tensor_to_filename == theirs.tensor_to_filename
    assert ours.metadata == theirs.metadata


def test_split_rules_without_the_hub():
    # [6, 6, 2, 6, 2, 2] with a limit of 10 -> [6], [6+2], [6+2+2] (huggingface_hub's docstring example)
    split = split_into_shards({c: s for c, s in zip("abcdef", [6, 6, 2, 6, 2, 2], strict=True)}, 10)
    assert list(split.filename_to_tensors.values()) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert list(split.filename_to_tensors) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    # a tensor over the limit gets its own shard; the open shard stays open
    split = split_into_shards({"a": 3, "big": 50, "b": 3}, 10)
    assert list(split.filename_to_tensors.values()) == [["big"], ["a", "b"]]
    assert split.metadata == {"total_size": 56}


@pytest.mark.parametrize(
    "text, value",
    [("5GB", 5 * 10**9), ("5gb", 5 * 10**9), ("1.5MB", 1_500_000), ("100KB", 100_000), ("2TB", 2 * 10**12),
     ("500MiB", 500 * 2**20), ("1GiB", 2**30), (" 10 KB ", 10_000), (12345, 12345)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["5", "5XB", "GB", "-1GB", 0, -5, 1.5, None, True, "5 G B"])
def test_parse_size_rejects(bad):
    with pytest.raises(SerializationError):
        parse_size(bad)


def test_filename_pattern(tmp_path):
    save_sharded(arrays(3), tmp_path, max_shard_size=300, filename_pattern="model.fp16{suffix}.safetensors")
    names = listing(tmp_path)
    assert "model.fp16.safetensors.index.json" in names
    assert "model.fp16-00001-of-00005.safetensors" in names
    with open_checkpoint(tmp_path / "model.fp16.safetensors.index.json") as c:
        assert len(c) == len(arrays(3))
    # a directory holding exactly one index is found too
    with open_checkpoint(tmp_path) as c:
        assert len(c) == len(arrays(3))
    for bad in ("model.safetensors", "sub/model{suffix}.safetensors", "model{suffix}.bin", ".x{suffix}.safetensors"):
        with pytest.raises(SerializationError):
            save_sharded(arrays(1), tmp_path / "x", filename_pattern=bad)


# --------------------------------------------------------------------------- atomic writes


def test_shared_memory_across_shards_is_rejected_before_writing(tmp_path):
    torch = pytest.importorskip("torch", reason="only torch tensors have storages to share")
    base = torch.zeros(1000)
    with pytest.raises(SerializationError, match="share memory"):
        save_sharded({"a": base, "pad": torch.ones(1000), "b": base[:10]}, tmp_path / "x", max_shard_size=4000)
    assert not (tmp_path / "x").exists()


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    dest = tmp_path / "ckpt"
    save_sharded(arrays(seed=1), dest, max_shard_size="2KB")
    before = {n: (dest / n).read_bytes() for n in listing(dest)}
    (dest / "config.json").write_text("{}")
    from engine.writing import writer

    real = writer.save_file
    calls = []

    def flaky(tensors, filename, metadata=None, **kw):
        calls.append(filename)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata, **kw)

    monkeypatch.setattr(writer, "save_file", flaky)
    with pytest.raises(OSError, match="No space left"):
        save_sharded(arrays(seed=2), dest, max_shard_size="1KB", max_workers=1)
    assert {n: (dest / n).read_bytes() for n in listing(dest) if n != "config.json"} == before
    assert listing(dest) == sorted([*before, "config.json"])  # no temporary directory left
    # a directory this call created is removed again
    calls.clear()
    with pytest.raises(OSError):
        save_sharded(arrays(seed=2), tmp_path / "new" / "ckpt", max_shard_size="1KB", max_workers=1)
    assert not (tmp_path / "new" / "ckpt").exists()


def test_failure_while_renaming_restores_previous_files(tmp_path, monkeypatch):
    dest = tmp_path / "ckpt"
    save_sharded(arrays(seed=1), dest, max_shard_size="2KB")
    before = {n: (dest / n).read_bytes() for n in listing(dest)}
    real = os.replace
    seen = []

    def failing(src, dst, *a, **kw):
        if str(dst).startswith(str(dest)) and os.path.dirname(str(dst)) == str(dest):
            seen.append(dst)
            if len(seen) == 3:
                raise OSError(5, "Input/output error")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(ck.os, "replace", failing)
    with pytest.raises(WriteError) as e:
        save_sharded(arrays(seed=2), dest, max_shard_size="2KB")
    assert isinstance(e.value.__cause__, OSError)
    monkeypatch.setattr(ck.os, "replace", real)
    assert {n: (dest / n).read_bytes() for n in listing(dest)} == before


def test_stale_files_of_a_previous_save_are_removed(tmp_path):
    dest = tmp_path
    (dest / "README.md").write_text("keep")
    (dest / "model.safetensors.backup").write_text("keep")
    save_sharded(arrays(2), dest)  # single
    assert "model.safetensors" in listing(dest)
    split = save_sharded(arrays(6), dest, max_shard_size="1KB")  # now sharded
    assert "model.safetensors" not in listing(dest)
    assert set(listing(dest)) == {*split.filename_to_tensors, "model.safetensors.index.json", "README.md",
                                  "model.safetensors.backup"}
    split = save_sharded(arrays(6), dest, max_shard_size="2KB")  # fewer shards
    assert set(listing(dest)) == {*split.filename_to_tensors, "model.safetensors.index.json", "README.md",
                                  "model.safetensors.backup"}
    save_sharded(arrays(1), dest)  # back to one file
    assert listing(dest) == ["README.md", "model.safetensors", "model.safetensors.backup"]


# --------------------------------------------------------------------------- index rules


def rewrite_index(path, mutate):
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    mutate(doc)
    index.write_text(json.dumps(doc))


def test_missing_shard(sharded):
    path, _, split = sharded
    victim = list(split.filename_to_tensors)[1]
    os.unlink(path / victim)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(MissingShardError) as e:
        open_checkpoint(path)
    assert isinstance(e.value, FileNotFoundError) and e.value.reason == "MissingShard"
    assert victim in str(e.value)
    if fds is not None:  # the shards that did open were closed again
        assert len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(MissingShardError):
        read_checkpoint_info(path)


def test_tensor_listed_but_absent(sharded):
    path, _, split = sharded
    rewrite_index(path, lambda d: d["weight_map"].update(ghost=list(split.filename_to_tensors)[0]))
    with pytest.raises(CheckpointIndexError) as e:
        open_checkpoint(path)
    assert e.value.reason == "TensorNotInShard" and e.value.tensors == ("ghost",)


def test_tensor_in_shard_but_not_in_index(sharded):
    path, _, split = sharded
    name = next(ts[1] for ts in split.filename_to_tensors.values() if len(ts) > 1)
    rewrite_index(path, lambda d: d["weight_map"].pop(name))
    with pytest.raises(CheckpointIndexError) as e:
        open_checkpoint(path)
    assert e.value.reason == "TensorNotInIndex" and e.value.tensors == (name,)


def test_shard_not_in_the_index_is_ignored(sharded):
    # as in transformers: only the files the index names belong to the checkpoint
    path, sd, split = sharded
    engine.numpy.save_file({"stray": np.zeros(1)}, path / "model-00099-of-00099.safetensors")
    with open_checkpoint(path) as c:
        assert c.keys() == sorted(sd)


def test_tensor_in_the_wrong_shard(sharded):
    path, _, split = sharded
    first, second = list(split.filename_to_tensors)[:2]
    name = split.filename_to_tensors[first][0]
    rewrite_index(path, lambda d: d["weight_map"].update({name: second}))
    with pytest.raises(CheckpointIndexError, match=f"it is in '{first}'") as e:
        open_checkpoint(path)
    assert e.value.reason == "TensorNotInShard"


def test_same_name_in_two_shards(tmp_path):
    engine.numpy.save_file({"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    engine.numpy.save_file({"a": np.zeros(3, np.float32)}, tmp_path / "s2.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}, "metadata": {}})
    )
    with open_checkpoint(tmp_path) as c:  # s2 is not in the index: never opened, nothing wrong
        assert c.keys() == ["a", "b"]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})
    )
    with pytest.raises(CheckpointIndexError) as e:
        open_checkpoint(tmp_path)
    assert e.value.reason == "DuplicateTensor" and e.value.tensors == ("a",)
    problems = check_checkpoint(tmp_path)
    assert [p.reason for p in problems] == ["DuplicateTensor", "TensorNotInShard"]


@pytest.mark.parametrize(
    "shard",
    ["../model.safetensors", "a/../../b.safetensors", "/etc/passwd", "http://example.com/x.safetensors",
     "s3://bucket/x.safetensors", "C:\\x.safetensors", "C:x.safetensors", "a\\..\\b", "", "./x.safetensors",
     "a//b.safetensors", "x\x00.safetensors"],
)
def test_unsafe_shard_names(tmp_path, shard):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(CheckpointIndexError) as e:
        open_checkpoint(tmp_path)
    assert e.value.reason == "UnsafeShardName"


def test_shards_in_a_subdirectory_are_fine(tmp_path):
    (tmp_path / "sub").mkdir()
    engine.numpy.save_file({"a": np.arange(3)}, tmp_path / "sub" / "s.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "sub/s.safetensors"}}))
    with open_checkpoint(tmp_path) as c:
        np.testing.assert_array_equal(c.get_tensor("a"), np.arange(3))


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '"weight_map"',
        "{",
        "{}",
        '{"metadata": {}}',
        '{"weight_map": []}',
        '{"weight_map": {"a": 1}}',
        '{"weight_map": {"a": null}}',
        '{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}',
        '{"weight_map": {}, "metadata": []}',
        b'\xff\xfe{"weight_map": {}}',
    ],
)
def test_malformed_index(tmp_path, text):
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointIndexError) as e:
        open_checkpoint(index)
    assert e.value.reason == "InvalidIndex" and str(index) in str(e.value)
    assert isinstance(e.value, ValueError)
    assert check_checkpoint(index)[0].reason == "InvalidIndex"


def test_parse_index_accepts_extra_keys_and_empty_map():
    assert parse_index(b'{"weight_map": {}, "other": 1}') == ({}, {})
    meta, wm = parse_index('{"metadata": {"total_size": 3}, "weight_map": {"x": "a.safetensors"}}')
    assert meta == {"total_size": 3} and wm == {"x": "a.safetensors"}


def test_index_too_large(tmp_path, sharded):
    path, _, _ = sharded
    with pytest.raises(CheckpointIndexError, match="limit"):
        open_checkpoint(path, max_header_size=100)


def test_corrupt_shard_is_a_header_error(sharded):
    path, _, split = sharded
    victim = path / list(split.filename_to_tensors)[0]
    data = bytearray(victim.read_bytes())
    victim.write_bytes(bytes(data[:-1]))  # one byte short
    with pytest.raises(HeaderError) as e:
        open_checkpoint(path)
    assert e.value.reason == "MetadataIncompleteBuffer"
    assert [p.reason for p in check_checkpoint(path)] == ["MetadataIncompleteBuffer"]


def test_directory_resolution(tmp_path):
    with pytest.raises(SafetensorError, match="no safetensors file"):
        open_checkpoint(tmp_path)
    engine.numpy.save_file({"a": np.zeros(1)}, tmp_path / "weights.safetensors")
    with open_checkpoint(tmp_path) as c:
        assert c.keys() == ["a"]
    engine.numpy.save_file({"b": np.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(SafetensorError, match="2 candidates"):
        open_checkpoint(tmp_path)
    # model.safetensors wins over an index, as in transformers
    save_sharded(arrays(4), tmp_path, max_shard_size=500)
    engine.numpy.save_file({"single": np.zeros(1)}, tmp_path / "model.safetensors")
    with open_checkpoint(tmp_path) as c:
        assert c.keys() == ["single"]


def test_read_checkpoint_info_local_single(tmp_path):
    engine.numpy.save_file({"a": np.zeros((2, 3), np.float32)}, tmp_path / "x.safetensors", metadata={"k": "v"})
    info = read_checkpoint_info(tmp_path / "x.safetensors")
    assert not info.is_sharded and info.shards == ["x.safetensors"] and info.metadata() == {"k": "v"}
    assert info.to_dict()["a"]["shape"] == [2, 3]
    assert info.parameters() == {"F32": 6, "total": 6}


def test_metadata_common_to_all_shards(tmp_path):
    engine.numpy.save_file({"a": np.zeros(1)}, tmp_path / "s1.safetensors", metadata={"format": "np", "x": "1"})
    engine.numpy.save_file({"b": np.zeros(1)}, tmp_path / "s2.safetensors", metadata={"format": "np", "x": "2"})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    with open_checkpoint(tmp_path) as c:
        assert c.metadata() == {"format": "np"}
        assert c.index_metadata == {}


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_numpy_load_file_of_a_checkpoint(sharded, backend):
    path, sd, split = sharded
    for where in (path, path / "model.safetensors.index.json"):
        loaded = engine.numpy.load_file(where, backend=backend)
        assert set(loaded) == set(sd)
        for name, a in sd.items():
            assert loaded[name].dtype == a.dtype and loaded[name].tobytes() == a.tobytes(), name


def test_public_names():
    from engine.apps import entry_points

    # the root's name also takes a URL, and opens a local path with this module's function
    assert engine.open_checkpoint is entry_points.open_checkpoint
    assert engine.save_sharded is save_sharded


def count_pipelines(monkeypatch):
    """Record the files of every pipeline run (one list of paths per run)."""
    from engine.loading import pipeline

    runs: list[list[str]] = []
    real = pipeline.run_sources

    def spy(sources, *args, **kwargs):
        runs.append([os.path.basename(s.path) for s in sources if s.requests])
        return real(sources, *args, **kwargs)

    monkeypatch.setattr(pipeline, "run_sources", spy)
    return runs


def test_parallel_paths(tmp_path, monkeypatch):
    # a slow first shard opens the rest in parallel; the load is one pipeline over all shards
    sd = {f"w{i}": np.full(3 << 20, i, np.float32) for i in range(4)}  # 4 x 12 MiB
    save_sharded(sd, tmp_path, max_shard_size="13MB")
    monkeypatch.setattr(engine.checkpoints.checkpoint_info, "_SLOW_OPEN_S", 0.0)
    runs = count_pipelines(monkeypatch)
    with open_checkpoint(tmp_path, backend="pread", max_workers=3) as c:
        assert len(c.shards) == 4
        out = c.get_tensors()
        assert runs == [c.shards]
        for name, a in sd.items():
            np.testing.assert_array_equal(out[name], a)
            assert out[name].flags.writeable
        sub = c.get_tensors(["w3", "w0", "w3"])
        assert list(sub) == ["w3", "w0"]
        assert sorted(runs[1]) == sorted({c.info.shard_of("w3"), c.info.shard_of("w0")})
        np.testing.assert_array_equal(sub["w3"], sd["w3"])


@pytest.mark.parametrize("framework", ["numpy", "pt"])
def test_owned_load_of_a_checkpoint_is_one_pipeline(sharded, monkeypatch, framework):
    # every shard's reads in one run: one queue, one set of threads, one allocation
    path, sd, split = sharded
    runs = count_pipelines(monkeypatch)
    with open_checkpoint(path, framework=framework, backend="pread") as c:
        out = c.get_tensors()
        with_bytes = [s for s in c.shards if c.info.headers[s].data_size]
        assert runs == [with_bytes] and len(with_bytes) > 2
        names = ["model.layers.7.weight", "lm_head.weight", "model.layers.0.bias", "empty"]
        sub = c.get_tensors(names)
        assert list(sub) == names and len(runs) == 2
    assert list(out) == [n for s in c.shards for n in c.info.headers[s].offset_keys()]

    def raw(x):
        return x.reshape(-1).view(torch_u8()).numpy().tobytes() if framework == "pt" else x.tobytes()

    for name, a in sd.items():
        assert raw(out[name]) == a.tobytes(), name
    for name in names:
        assert raw(sub[name]) == sd[name].tobytes(), name
    if framework == "pt":  # each tensor its own storage, as on one file
        ptrs = {t.untyped_storage().data_ptr() for t in out.values() if t.numel()}
        assert len(ptrs) == sum(1 for a in sd.values() if a.size)


@pytest.mark.parametrize("gpu_path", ["copy", "auto"])
def test_device_load_of_a_checkpoint_is_one_pipeline(sharded, monkeypatch, gpu_path):
    from engine.loading import pipeline

    path, sd, split = sharded
    from emucudart import EmulatedRingOps, EmulatedSink, Emulator

    emulator = Emulator()
    emulator.reset()
    sink = EmulatedSink(EmulatedRingOps(emulator))
    monkeypatch.setattr(engine.loading, "get_sink", lambda kind, device: sink)
    monkeypatch.setattr(engine.loading, "sink_kind", lambda framework, device: sink.name)
    real = pipeline.run_sources
    monkeypatch.setattr(pipeline, "run_sources", lambda *a, **k: real(*a, **{**k, "gpu_path": gpu_path}))
    runs = count_pipelines(monkeypatch)
    try:
        with open_checkpoint(path, device="emulated") as c:
            out = c.get_tensors()
            with_bytes = [s for s in c.shards if c.info.headers[s].data_size]
            assert runs == [with_bytes] and sink.allocations == [len(sd)]
            sub = c.get_tensors(["lm_head.weight", "model.layers.0.bias"])
            assert sink.allocations == [len(sd), 2] and sink.per_tensor == [True, True]
    finally:
        emulator.assert_clean()
        sink.ops.close()
    for name, a in sd.items():
        assert out[name].tobytes() == a.tobytes(), name
    assert sub["lm_head.weight"].tobytes() == sd["lm_head.weight"].tobytes()
    assert emulator.stats()["copies"] > 0


def torch_u8():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    return torch.uint8


def test_load_into_a_checkpoint(sharded, monkeypatch):
    path, sd, split = sharded
    runs = count_pipelines(monkeypatch)
    dest = {n: np.zeros_like(a) for n, a in sd.items()}
    for where in (path, path / "model.safetensors.index.json"):
        for d in dest.values():
            d[...] = 0
        runs.clear()
        filled = engine.load_into(where, dest, strict=True)
        assert sorted(filled) == sorted(sd) and len(runs) == 1
        for n, a in sd.items():
            assert dest[n].tobytes() == a.tobytes(), n
    with open_checkpoint(path) as c:
        assert filled == [n for s in c.shards for n in c.info.headers[s].offset_keys()]
        part = {"lm_head.weight": np.zeros((64, 64), np.float16)}
        assert c.load_into(part) == ["lm_head.weight"]
        assert part["lm_head.weight"].tobytes() == sd["lm_head.weight"].tobytes()
        with pytest.raises(TensorNotFoundError) as e:
            c.load_into(part, strict=True)
        assert e.value.path == str(path) and "model.layers.0.bias" in e.value.tensors
        with pytest.raises(TensorNotFoundError) as e:
            c.load_into({"nope": np.zeros(1)})
        assert list(e.value.tensors) == ["nope"]
        with pytest.raises(engine.TensorMismatchError) as e:  # checked before anything is read
            c.load_into({"lm_head.weight": np.zeros((64, 64), np.float32)})
        assert e.value.path == str(path / c.info.shard_of("lm_head.weight"))
    # a single file still goes through the file path
    single = path / c.info.shard_of("lm_head.weight")
    one = {"lm_head.weight": np.zeros((64, 64), np.float16)}
    assert engine.load_into(single, one) == ["lm_head.weight"]
    assert one["lm_head.weight"].tobytes() == sd["lm_head.weight"].tobytes()


def test_read_errors_in_parallel_loads_propagate(tmp_path, monkeypatch):
    sd = {f"w{i}": np.full(3 << 20, i, np.float32) for i in range(3)}
    save_sharded(sd, tmp_path, max_shard_size="13MB")
    with open_checkpoint(tmp_path, backend="pread") as c:
        victim = c.shards[1]
        with open(tmp_path / victim, "r+b") as f:  # shrink the shard after opening
            f.truncate(1000)
        with pytest.raises(engine.ReadError) as e:
            c.get_tensors()
        assert victim in str(e.value)


def test_engine_stream_of_a_directory_or_an_index_reads_every_shard_as_one_pipeline(sharded, monkeypatch):
    path, sd, _ = sharded
    runs = count_pipelines(monkeypatch)
    for where in (path, path / "model.safetensors.index.json"):
        got = dict(engine.stream(where, framework="np"))
        assert sorted(got) == sorted(sd) and all(got[k].tobytes() == sd[k].tobytes() for k in sd)
    assert len(runs) == 2  # one pipeline per load, not one per shard
    some = dict(engine.stream(path, framework="np", patterns="lm_head.*"))
    assert sorted(some) == sorted(k for k in sd if k.startswith("lm_head."))
