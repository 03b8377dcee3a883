"""engine.shards: save_sharded under failure: killed saves, stale hidden directories, error paths.

The split, names and index JSON against huggingface_hub are tested in test_checkpoint.py,
next to the reader of what they write.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors.numpy as ref_np

from engine import _atomic
from engine.errors import SerializationError, WriteError
from engine.shards import save_sharded

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

    from engine import writer

    def failing(fd, data, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer, "_write_at", failing)
    with pytest.raises(WriteError) as w:
        save_sharded(_arrays(1), dest, max_shard_size=4 << 20, max_workers=1)
    assert w.value.path == str(dest / "model-00001-of-00004.safetensors")
    assert "Input/output error" in str(w.value) and not dest.exists()
