"""Slice plans: the byte runs of ``tensor[index]`` against numpy indexing as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import SafetensorError
from engine.plan import InvalidSliceError, plan_slice


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
