"""engine.checkpoints.shards: save_sharded under failure: killed saves, stale hidden directories, error paths;
and its files byte for byte against huggingface_hub's and transformers'.

The split and names against huggingface_hub are also tested in test_checkpoint.py, next to the
reader of what they write.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors.numpy as ref_np

from engine.base import _atomic
from engine.checkpoints.shards import save_sharded
from engine.errors import SerializationError, WriteError

KILL_SHARDED = """
seed = int(os.environ["SEED"])
arrays = {f"t{i}": np.full((1 << 19,), seed * 16 + i, np.float32) for i in range(8)}
print("ready", flush=True)
engine.save_sharded(arrays, os.environ["DEST"], max_shard_size=4 << 20, fsync=os.environ["FSYNC"] == "1")
"""


def _arrays(seed: int) -> dict:
    return {f"t{i}": np.full((1 << 19,), seed * 16 + i, np.float32) for i in range(8)}


def _kill_sharded_saves(tmp_path, kills: int) -> int:
    """Kill saves until ``kills`` kills landed during a save (at most 3x as many rounds)."""
    import time

    import killsave

    rng = np.random.default_rng(kills)
    dest = tmp_path / "ckpt"
    t0 = time.perf_counter()
    split = save_sharded(_arrays(0), dest, max_shard_size=4 << 20)
    window = 1.5 * (time.perf_counter() - t0) + 0.01
    names = sorted([*split.filename_to_tensors, "model.safetensors.index.json"])
    assert len(names) == 5
    killed = 0
    for r in range(1, 3 * kills + 1):
        if killed >= kills:
            break
        env = {"DEST": str(dest), "SEED": str(r), "FSYNC": str(r % 2)}
        landed = killsave.kill_during(KILL_SHARDED, window, rng, env=env)
        killed += landed
        # keep the kills inside the saves on a machine whose speed changes under load
        window = window * 1.1 if landed else max(0.005, window * 0.6)
        entries = sorted(os.listdir(dest))
        visible = [e for e in entries if not e.startswith(".")]
        hidden = [e for e in entries if e.startswith(".")]
        assert visible == names, entries
        for shard in split.filename_to_tensors:
            loaded = ref_np.load_file(str(dest / shard))  # every file whole, old or new
            for k, v in loaded.items():
                seed = int(v[0]) // 16
                assert np.array_equal(v, _arrays(seed)[k]), (r, shard, k)
        assert all(h.startswith(".model.checkpoint.") and h.endswith(".tmp") for h in hidden), hidden
        if hidden:
            save_sharded(_arrays(r), dest, max_shard_size=4 << 20)  # removes the dead save's directory
            assert sorted(os.listdir(dest)) == names
    return killed


def test_killed_sharded_saves_leave_whole_files_and_no_litter(tmp_path):
    assert _kill_sharded_saves(tmp_path, 3) == 3


@pytest.mark.slow
def test_killed_sharded_saves_leave_whole_files_and_no_litter_many(tmp_path):
    assert _kill_sharded_saves(tmp_path, 30) == 30


def test_a_live_saves_hidden_directory_is_left_alone(tmp_path):
    dest = tmp_path / "ckpt"
    dest.mkdir()
    path, fd = _atomic.make_temp_dir(str(dest), "model.checkpoint")  # a save in progress
    try:
        save_sharded(_arrays(1), dest, max_shard_size=4 << 20)
        assert os.path.isdir(path)
    finally:
        os.close(fd)


def test_errors_name_the_checkpoint_directory_not_the_hidden_one(tmp_path, monkeypatch):
    dest = tmp_path / "ckpt"
    with pytest.raises(SerializationError) as e:
        save_sharded({"a" * 200: np.zeros(1, np.float32)}, dest, max_header_size=64)
    assert e.value.reason == "HeaderTooLarge"
    assert e.value.path == str(dest / "model.safetensors")
    assert not dest.exists()

    from engine.writing import _file_writes

    def failing(fd, data, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_file_writes, "write_at", failing)
    with pytest.raises(WriteError) as w:
        save_sharded(_arrays(1), dest, max_shard_size=4 << 20, max_workers=1)
    assert w.value.path == str(dest / "model-00001-of-00004.safetensors")
    assert "Input/output error" in str(w.value) and not dest.exists()


# --------------------------------------------------------------------------- the Hugging Face files


def _files(path) -> dict:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def _state_dict(torch):
    torch.manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(8 + i, 16) for i in range(6)}
    sd["layers.0.bias"] = torch.randn(8, dtype=torch.bfloat16)
    sd["huge"] = torch.randn(1200)  # larger than a shard: a shard of its own
    sd["step"] = torch.tensor(3)
    return sd


@pytest.mark.parametrize("max_shard_size", ["2KB", "5GB"])
def test_default_files_equal_huggingface_hub_byte_for_byte(tmp_path, max_shard_size):
    """Shards had no "format": "pt" metadata by default and the index was sorted with a
    final newline; huggingface_hub.save_torch_state_dict writes neither."""
    torch = pytest.importorskip("torch")
    hub = pytest.importorskip("huggingface_hub")
    sd = _state_dict(torch)
    (tmp_path / "hub").mkdir()
    hub.save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=max_shard_size)
    split = save_sharded(sd, tmp_path / "ours", max_shard_size=max_shard_size)
    theirs, ours = _files(tmp_path / "hub"), _files(tmp_path / "ours")
    assert list(ours) == list(theirs)
    assert split.is_sharded == (max_shard_size == "2KB") == (len(theirs) > 2)
    for name in theirs:
        assert ours[name] == theirs[name], name


def test_numpy_arrays_get_no_format_metadata(tmp_path):
    save_sharded({"a": np.arange(4, dtype=np.float32)}, tmp_path)
    with ref_np.safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert f.metadata() is None  # as safetensors.numpy.save_file writes


def test_transformers_index_equals_save_pretrained(tmp_path):
    """index_format="transformers": save_pretrained's index (sorted, final newline,
    total_parameters) and shards, byte for byte."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "tf", max_shard_size="4KB")
    save_sharded(model.state_dict(), tmp_path / "ours", max_shard_size="4KB", index_format="transformers")
    theirs, ours = _files(tmp_path / "tf"), _files(tmp_path / "ours")
    assert len(ours) > 2 and set(ours) <= set(theirs)
    for name in ours:
        assert ours[name] == theirs[name], name
    assert b'"total_parameters": ' + str(model.num_parameters()).encode() in ours["model.safetensors.index.json"]


def test_unknown_index_format_is_refused_before_writing(tmp_path):
    with pytest.raises(SerializationError, match="index_format") as e:
        save_sharded({"a": np.zeros(3, np.float32)}, tmp_path / "x", index_format="sorted")
    assert e.value.reason == "InvalidIndexFormat" and not (tmp_path / "x").exists()
