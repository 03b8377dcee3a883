"""engine.gpu.device_staging: the copy path's staging slots kept between loads, on request."""

from __future__ import annotations

import os

import numpy as np
from emulated import EmulatedDevice

from engine.gpu import device_staging
from engine.loading import pipeline
from engine.planning.plan import plan_reads


class _KeyedDevice(EmulatedDevice):
    """The emulated device, naming its slots' kind so that they may be kept between loads."""

    staging_key = ("emulated",)


def _two_tensor_load(tmp_path):
    """A 3 MiB file of two tensors (1 and 2 MiB), its open descriptor and read plan, and a
    keyed device whose staging allocations are noted (their sizes, in ``allocs``)."""
    data = os.urandom(3 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    begins, ends = np.array([0, 1 << 20]), np.array([1 << 20, 3 << 20])
    requests = plan_reads(begins, ends, [0, 1], 0, 1 << 20, 64)
    dev = _KeyedDevice()
    allocs: list[int] = []
    real_alloc = dev.alloc_staging
    dev.alloc_staging = lambda n: allocs.append(n) or real_alloc(n)
    return data, os.open(path, os.O_RDONLY), requests, dev, allocs


def test_kept_staging_is_reused_by_the_next_load_and_freed_on_release(tmp_path):
    data, fd, requests, dev, allocs = _two_tensor_load(tmp_path)
    try:
        device_staging.keep_staging(True)
        for _ in range(3):
            out = {0: bytearray(1 << 20), 1: bytearray(2 << 20)}
            pipeline.run(fd, requests, pipeline.Destination(device_targets=out, device_ops=dev), gpu_path="copy",
                         slot_bytes=1 << 20)
            assert bytes(out[0]) + bytes(out[1]) == data
        assert len(allocs) == 2  # the two slots of the first load, kept for the next two
        assert dev.live_staging  # still allocated while kept
        device_staging.keep_staging(False)
        assert not dev.live_staging  # released
        out = {0: bytearray(1 << 20), 1: bytearray(2 << 20)}
        pipeline.run(fd, requests, pipeline.Destination(device_targets=out, device_ops=dev), gpu_path="copy",
                     slot_bytes=1 << 20)
        assert len(allocs) == 4 and not dev.live_staging  # not kept: allocated and freed again
    finally:
        device_staging.keep_staging(False)
        os.close(fd)
        dev.close()


def test_a_smaller_load_takes_the_larger_kept_slots(tmp_path):
    """Slot sizes follow each load's size: a later, smaller load uses the kept larger slots
    instead of page-locking new ones; a larger one allocates its own, and at most MAX_KEPT
    stay kept."""
    data, fd, requests, dev, allocs = _two_tensor_load(tmp_path)
    try:
        device_staging.keep_staging(True)
        counts = []
        for slot_bytes in (2 << 20, 1 << 20, 512 << 10, 3 << 20):
            out = {0: bytearray(1 << 20), 1: bytearray(2 << 20)}
            pipeline.run(fd, requests, pipeline.Destination(device_targets=out, device_ops=dev), gpu_path="copy",
                         slot_bytes=slot_bytes)
            assert bytes(out[0]) + bytes(out[1]) == data
            counts.append(len(allocs))
        # two slots for the first load; the smaller loads allocate none; the larger (one
        # 3 MiB unit) one slot of its own size
        assert counts == [2, 2, 2, 3] and allocs[2] > allocs[0]
        assert len(device_staging.KEPT_STAGING.kept[("emulated",)]) <= device_staging.KeptStaging.MAX_KEPT
    finally:
        device_staging.keep_staging(False)
        os.close(fd)
        dev.close()
    assert not dev.live_staging
