"""Slice plans: the byte runs of ``tensor[index]`` against numpy indexing as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import SafetensorError
from engine.planning.plan import InvalidSliceError, plan_slice


def _apply(arr: np.ndarray, index):
    """Read ``arr[index]`` the way a backend does: run by run, then flip and squeeze."""
    plan = plan_slice(arr.shape, arr.itemsize, index)
    raw = arr.tobytes()
    data = b"".join(raw[s : s + plan.run_bytes] for s in plan.src.tolist())
    out = np.frombuffer(data, arr.dtype).reshape(plan.out_shape)
    if plan.flip:
        out = np.flip(out, plan.flip)
    return out.reshape(plan.result_shape), plan


@st.composite
def shape_and_index(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    parts = []
    for dim in shape:
        bound = st.none() | st.integers(-dim - 2, dim + 2)
        choice = st.builds(slice, bound, bound, st.none() | st.integers(-4, 4).filter(bool))
        if dim:
            choice = choice | st.integers(-dim, dim - 1)
        parts.append(draw(choice))
    # an ellipsis stands for any run of axes (possibly none); otherwise trailing axes may be left out
    lo = draw(st.integers(0, len(parts)))
    hi = draw(st.integers(lo, len(parts)))
    if draw(st.booleans()):
        parts[lo:hi] = [Ellipsis]
    else:
        del parts[lo:]
    return shape, tuple(parts)


@settings(max_examples=400, deadline=None)
@given(shape_and_index(), st.sampled_from([1, 2, 4, 8]))
def test_runs_reproduce_numpy_indexing(case, itemsize):
    shape, index = case
    dtype = {1: np.uint8, 2: np.int16, 4: np.float32, 8: np.int64}[itemsize]
    arr = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    got, plan = _apply(arr, index)
    np.testing.assert_array_equal(got, arr[index])
    assert got.shape == arr[index].shape
    # never more bytes than the selection holds
    assert plan.nbytes == arr[index].nbytes
    # runs are in increasing file order and never overlap
    src = plan.src
    assert np.all(np.diff(src) >= plan.run_bytes)
    # the forward index selects the same elements as the runs
    fwd = arr[plan.forward_index]
    if plan.flip:
        fwd = np.flip(fwd, plan.flip_squeezed)
    np.testing.assert_array_equal(fwd, arr[index])


def test_row_block_is_one_run_and_column_block_one_run_per_row():
    rows = plan_slice((4096, 4096), 2, slice(100, 200))
    assert rows.src.size == 1 and rows.run_bytes == 100 * 4096 * 2
    cols = plan_slice((4096, 4096), 2, (slice(None), slice(0, 2048)))
    assert cols.src.size == 4096 and cols.run_bytes == 2048 * 2
    assert cols.src[1] - cols.src[0] == 4096 * 2
    whole = plan_slice((8, 8), 4, Ellipsis)
    assert whole.src.tolist() == [0] and whole.run_bytes == 256


@pytest.mark.parametrize(
    "index, match",
    [
        ((0, 0, 0), "too many"),
        (5, "out of bounds"),
        (-6, "out of bounds"),
        ((Ellipsis, Ellipsis), "single ellipsis"),
        ("x", "unsupported index"),
        (None, "unsupported index"),
        ([1, 2], "unsupported index"),
        (1.0, "unsupported index"),
        (True, "boolean"),
    ],
)
def test_invalid_indices(index, match):
    with pytest.raises(InvalidSliceError, match=match) as info:
        plan_slice((5, 3), 4, index)
    assert isinstance(info.value, IndexError) and isinstance(info.value, SafetensorError)


def test_numpy_integer_types_are_indices():
    plan = plan_slice((5, 3), 4, (np.int64(2), np.int32(-1)))
    assert plan.result_shape == () and plan.src.tolist() == [(2 * 3 + 2) * 4]


# -- whole-tensor read plans -------------------------------------------------------------------------
from engine.planning.plan import plan_reads  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=30),
    pick=st.data(),
    chunk=st.integers(1, 9000),
    max_pieces=st.integers(1, 5),
)
def test_plan_reads_covers_exactly_the_selected_bytes(sizes, pick, chunk, max_pieces):
    ends = np.cumsum(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)
    begins = ends - np.asarray(sizes, dtype=np.int64)
    rows = sorted(pick.draw(st.sets(st.integers(0, max(len(sizes) - 1, 0)))) if sizes else set())
    reqs = plan_reads(begins, ends, rows, 100, chunk, max_pieces)
    effective = max(64, chunk - chunk % 64)
    covered = {}
    prev_end = -1
    for r in reqs:
        assert r.nbytes <= effective and len(r.pieces) <= max_pieces
        assert r.offset >= prev_end  # file order, no overlap
        prev_end = r.offset + r.nbytes
        assert sum(p.nbytes for p in r.pieces) == r.nbytes
        pos = r.offset
        for p in r.pieces:
            assert p.request_offset == pos - r.offset
            assert pos == 100 + begins[p.row] + p.tensor_offset  # piece sits where its bytes are
            assert p.tensor_offset % 64 == 0 or p.tensor_offset == 0  # whole elements per piece
            covered.setdefault(p.row, []).append((p.tensor_offset, p.nbytes))
            pos += p.nbytes
    for row in rows:
        parts = sorted(covered.get(row, []))
        assert sum(n for _, n in parts) == sizes[row]
        assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:], strict=False))
    assert set(covered) == {r for r in rows if sizes[r]}


def test_plan_reads_gap_ends_a_request():
    begins, ends = np.array([0, 10, 20]), np.array([10, 20, 30])
    reqs = plan_reads(begins, ends, [0, 2], 8, 1 << 20)
    assert [(r.offset, r.nbytes) for r in reqs] == [(8, 10), (28, 10)]
    assert [(r.offset, r.nbytes) for r in plan_reads(begins, ends, [0, 1, 2], 8, 1 << 20)] == [(8, 30)]


def test_empty_list_selects_nothing():
    """``t[[]]`` selects no rows, as numpy and the reference do; other lists stay refused."""
    plan = plan_slice((10, 5), 4, [])
    assert plan.out_shape == (0, 5) and plan.nbytes == 0
    plan = plan_slice((10, 5), 4, (slice(2, 4), []))
    assert plan.out_shape == (2, 0) and plan.nbytes == 0
    with pytest.raises(InvalidSliceError):
        plan_slice((10, 5), 4, [0, 1])
