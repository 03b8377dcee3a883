"""The dtype table against the reference's names, ml_dtypes and torch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import in_threads, run_python

from engine.base import dtypes
from engine.errors import SerializationError

REFERENCE_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
                   "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


def test_all_22_dtypes_in_the_reference_order():
    assert list(dtypes.NAMES) == REFERENCE_ORDER


@pytest.mark.parametrize("d", dtypes.DTYPES, ids=lambda d: d.name)
def test_numpy_mapping(d):
    np_dt = dtypes.numpy_dtype(d.code)
    if d.sub_byte:
        assert np_dt == np.uint8
    else:
        assert np_dt.itemsize * 8 == d.bits
        assert dtypes.from_numpy(np_dt) == d.code
        assert dtypes.from_numpy(np_dt.newbyteorder(">")) == d.code
        assert np_dt.byteorder in "<|="


def test_ml_dtypes_give_numpy_users_bf16_and_fp8():
    assert dtypes.numpy_dtype(dtypes.BY_NAME["BF16"].code) == np.dtype(ml_dtypes.bfloat16)
    assert dtypes.numpy_dtype(dtypes.BY_NAME["F8_E4M3"].code) == np.dtype(ml_dtypes.float8_e4m3fn)
    assert dtypes.numpy_dtype(dtypes.BY_NAME["F8_E8M0"].code) == np.dtype(ml_dtypes.float8_e8m0fnu)


def test_unsupported_numpy_dtype():
    with pytest.raises(SerializationError):
        dtypes.from_numpy(np.dtype("U3"))
    with pytest.raises(SerializationError):
        dtypes.code_of("F12")


def test_torch_mapping():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    for d in dtypes.DTYPES:
        t = dtypes.torch_dtype(d.code)
        if d.name == "F4" and hasattr(torch, "float4_e2m1fn_x2"):
            assert t == torch.float4_e2m1fn_x2  # torch's packed FP4, as the reference hands it out
        elif d.sub_byte:
            assert t == torch.uint8
        else:
            assert t.itemsize * 8 == d.bits
            assert dtypes.from_torch(t) == d.code
    assert dtypes.from_torch(torch.float4_e2m1fn_x2) == dtypes.BY_NAME["F4"].code
    with pytest.raises(SerializationError):
        dtypes.from_torch(torch.quint8)


@pytest.mark.parametrize(
    "name, shape, nbytes, expected",
    [("F4", (4, 8), 16, (4, 4)), ("F4", (3,), 2, (2,)), ("F6_E2M3", (2, 4), 6, (2, 3)), ("F6_E3M2", (4, 2), 6, (6,)),
     ("F32", (2, 3), 24, (2, 3)), ("F4", (), 1, (1,))],
)
def test_packed_shape(name, shape, nbytes, expected):
    assert dtypes.packed_shape(dtypes.BY_NAME[name].code, shape, nbytes) == expected


def test_own_numpy_dtype_is_numpy_s_whether_or_not_ml_dtypes_is_loaded():
    """numpy's own dtype or None (BF16, FP8), the same before and after ml_dtypes registers
    its names with numpy, and without importing ml_dtypes."""
    code = (
        "import sys\n"
        "from engine.base import dtypes\n"
        "def table():\n"
        "    return [(d.name, str(dtypes.own_numpy_dtype(d.code))) for d in dtypes.DTYPES]\n"
        "before = table()\n"
        "print('ml_dtypes' in sys.modules)\n"
        "import ml_dtypes\n"
        "print(table() == before)\n"
        "print(sorted(n for n, t in before if t == 'None'))\n"
    )
    lines = run_python(code).splitlines()
    assert lines[0] == "False" and lines[1] == "True"
    assert lines[2] == str(sorted(d.name for d in dtypes.DTYPES if d.name == "BF16" or d.name.startswith("F8_")))
    for d in dtypes.DTYPES:
        own = dtypes.own_numpy_dtype(d.code)
        assert own is None or own == dtypes.numpy_dtype(d.code), d.name


def test_from_numpy_table_is_whole_under_threads():
    """The reverse table is published whole: threads racing on its first use all find
    their dtype."""

    dtypes._FROM_NUMPY = {}
    names = [d.name for d in dtypes.DTYPES if not d.sub_byte]

    def work():
        for n in names:
            assert dtypes.from_numpy(dtypes.numpy_dtype(dtypes.BY_NAME[n].code)) == dtypes.BY_NAME[n].code

    in_threads(*[work] * 8)
