"""The format's dtypes as plain rows: what the header parser needs at import, without the
rest of :mod:`engine.base.dtypes` (a first open imports only this).

Row ``code`` is ``(name, bits, numpy, torch)``; the order is the reference's enum order (see
:mod:`engine.base.dtypes`, which builds its table from these rows).
"""

ROWS = (
    ("BOOL", 8, "bool", "bool"),
    ("F4", 4, "uint8", None),
    ("F6_E2M3", 6, "uint8", None),
    ("F6_E3M2", 6, "uint8", None),
    ("U8", 8, "uint8", "uint8"),
    ("I8", 8, "int8", "int8"),
    ("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("I16", 16, "int16", "int16"),
    ("U16", 16, "uint16", "uint16"),
    ("F16", 16, "float16", "float16"),
    ("BF16", 16, "bfloat16", "bfloat16"),
    ("I32", 32, "int32", "int32"),
    ("U32", 32, "uint32", "uint32"),
    ("F32", 32, "float32", "float32"),
    ("C64", 64, "complex64", "complex64"),
    ("F64", 64, "float64", "float64"),
    ("I64", 64, "int64", "int64"),
    ("U64", 64, "uint64", "uint64"),
)
#: Format names indexed by code; the Cython parser hands out codes.
NAMES = tuple(row[0] for row in ROWS)
#: Bits per element indexed by code.
BITS = tuple(row[1] for row in ROWS)
