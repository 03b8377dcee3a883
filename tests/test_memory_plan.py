"""engine.planning.memory: ``memory_limit=`` checked, and what it sizes (a group load's rounds
and window, a device load's ring), with the figures named where a limit cannot be met."""

from __future__ import annotations

import numpy as np
import pytest

from engine.apps.entry_points import memory_limit
from engine.errors import OptionError
from engine.gpu.geometry import default_geometry
from engine.planning import memory

MIB = 1 << 20


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True])
def test_a_limit_is_none_or_bytes(bad):
    with pytest.raises(OptionError) as e:
        memory.checked(bad)
    assert e.value.option == "memory_limit"
    assert memory.checked(None) is None and memory.checked(0) == 0


def test_rounds_fit_the_limit_two_at_a_time_where_they_can():
    assert memory.rounds(None, 4 * MIB, 32 * MIB) == (32 * MIB, 2)  # the default plan
    assert memory.rounds(128 * MIB, 4 * MIB, 32 * MIB) == (32 * MIB, 2)
    assert memory.rounds(16 * MIB, 4 * MIB, 32 * MIB) == (8 * MIB, 2)
    assert memory.rounds(6 * MIB, 4 * MIB, 32 * MIB) == (6 * MIB, 1)  # not two of the largest tensor
    assert memory.rounds(0, 4 * MIB, 32 * MIB) == (4 * MIB, 1)  # 0: the largest tensor
    for limit in (0, 6 * MIB, 16 * MIB, 128 * MIB):  # whatever round the group agrees on (at most this one's)
        size, _ = memory.rounds(limit, 4 * MIB, 32 * MIB)
        for agreed in (size, size // 2, 1):
            assert memory.in_flight(limit, agreed, 4 * MIB) * max(agreed, 4 * MIB) <= max(limit, 4 * MIB)


def test_a_limit_below_the_largest_tensor_names_both():
    with pytest.raises(OptionError, match="memory_limit=1000 bytes is below the largest tensor's 4096 bytes") as e:
        memory.rounds(1000, 4096, 32 * MIB, "model.safetensors")
    assert e.value.reason == "MemoryLimitTooLow" and e.value.path == "model.safetensors"


def test_a_device_ring_is_sized_within_the_limit():
    ring = default_geometry()
    options = {"memory_limit": ring.pinned_bytes // 4}
    memory_limit(options, True)
    assert "memory_limit" not in options and options["slot_bytes"] * ring.chunks <= ring.pinned_bytes // 4
    options = {"memory_limit": 1}
    with pytest.raises(OptionError, match=f"below the {4096 * ring.chunks} bytes"):
        memory_limit(options, True)
    with pytest.raises(OptionError, match="engine.stream sizes its ring"):  # a path that cannot size it
        memory_limit({"memory_limit": ring.pinned_bytes // 4}, True, sizes_ring=False)
    options = {"memory_limit": 1}
    memory_limit(options, False)  # a host load stages nothing beyond its outputs
    assert options == {}


def test_every_entry_point_takes_a_limit(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import engine.numpy
    import engine.torch

    path = str(tmp_path / "m.safetensors")
    engine.save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    assert engine.torch.load_file(path, memory_limit=0)["a"].sum() == 66
    assert engine.numpy.load_file(path, memory_limit=0)["a"].sum() == 66
    assert [n for n, _ in engine.stream(path, memory_limit=0)] == ["a"]
    dest = {"a": torch.zeros(3, 4)}
    assert engine.load_into(path, dest, memory_limit=0) == ["a"] and dest["a"].sum() == 66
    for load in (engine.torch.load_file, engine.numpy.load_file):
        with pytest.raises(OptionError):
            load(path, memory_limit=-5)
