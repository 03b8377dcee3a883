"""engine.gpu.device_units: how a device load is cut into units, and which path takes the last one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu import device_units
from engine.planning.plan import plan_reads


def _layout():
    """40 'tensors' of random sizes (some empty), back to back after a 64-byte 'header'."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300_000, 40)
    sizes[::7] = 0
    ends = np.cumsum(sizes)
    return ends - sizes, ends


BEGINS, ENDS = _layout()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(0, 39), unique=True, min_size=1),
    chunk=st.sampled_from([4096, 65_536, 1 << 20]),
    slot_bytes=st.sampled_from([100, 4096, 5000, 65_536, 1 << 20]),
    splittable=st.booleans(),
)
def test_units_cover_every_planned_byte_once_within_their_slot(rows, chunk, slot_bytes, splittable):
    begins, ends = BEGINS, ENDS
    rows = sorted(rows, key=lambda r: begins[r])
    requests = plan_reads(begins, ends, rows, 64, chunk)
    units = device_units.units(0, requests, slot_bytes, splittable)
    got_bytes: dict[int, list] = {}
    align = device_units.SLOT_ALIGN
    for u in units:
        assert u.nbytes <= slot_bytes or (not splittable and len(u.requests) == 1)
        # padded for alignment, a unit still fits the slot as allocated (SLOT_ALIGN larger)
        assert u.end <= slot_bytes + align or (not splittable and len(u.requests) == 1 and u.end < u.nbytes + align)
        in_file = u.copies(0, from_file=True)
        for key, toff, foff, n in in_file:
            assert foff == 64 + int(begins[key]) + toff  # the file offset of the tensor's bytes
            got_bytes.setdefault(key, []).append((toff, n))
        in_slot = u.copies(0, from_file=False)
        assert len(in_slot) == len(in_file)
        for (_key, _toff, soff, n), (_, _, foff, _) in zip(in_slot, in_file, strict=True):
            assert 0 <= soff and soff + n <= u.end
            assert soff % align == foff % align  # the slot byte shares its file byte's place in a line
        ends_in_slot = sorted((soff, soff + n) for _, _, soff, n in in_slot)
        assert all(a[1] <= b[0] for a, b in zip(ends_in_slot, ends_in_slot[1:], strict=False))  # no overlap
    for r in (r for r in rows if ends[r] > begins[r]):
        spans = sorted(got_bytes[r])
        pos = 0
        for toff, n in spans:
            assert toff == pos
            pos += n
        assert pos == int(ends[r] - begins[r])
    assert sum(u.nbytes for u in units) == sum(r.nbytes for r in requests)
