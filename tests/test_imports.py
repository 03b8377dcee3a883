"""What each entry point imports, in a fresh interpreter: short-lived tools pay for every
import, so each common use loads only what it needs (``import engine`` imports no numpy,
torch, CuPy or Numba; numpy callers never import torch; a plain load imports no Numba ...).

One table: each case runs ``setup`` (not counted), then ``code``, and lists the modules
that ``code`` must not have imported (a name also stands for its submodules); ``then``,
where given, runs next and must import each of ``present``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from conftest import run_python

import engine
import engine.numpy


class Case(NamedTuple):
    code: str
    absent: tuple[str, ...]
    setup: str = ""
    then: str = ""
    present: tuple[str, ...] = ()
    needs: str = ""  # an optional extra's package: the case is skipped without it


#: what a first safe_open of a local file must not import: no HTTP, asyncio, test modules,
#: thread pools, kernels, checkpoint code or mmap
_OPEN_ABSENT = (
    "urllib", "http", "asyncio", "unittest", "ssl", "email", "certifi", "concurrent", "numba", "torch", "queue",
    "json", "engine.loading.loader", "engine.loading.pipeline", "engine.urls.remote", "engine.statistics", "engine.numerics",
    "engine.checkpoints.checkpoint", "mmap",
)

CASES = {
    "import engine": Case("import engine\n", ("torch", "cupy", "numba")),
    "first safe_open of a file": Case(
        "with engine.safe_open(P, framework='np') as f:\n"
        "    [f.get_slice(k).get_shape() for k in f.keys()]\n",
        _OPEN_ABSENT,
        setup="import engine, numpy\n",
    ),
    "reading headers, then an array": Case(
        "with engine.safe_open(P, framework='np') as f:\n"
        "    rows = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]\n"
        "    assert rows == [('a', 'F32', [2, 3]), ('b', 'I8', [4])] and f.metadata() == {'k': 'v'}, rows\n"
        "    h = engine.read_header(P)\n"
        "    assert h.dtypes == ['F32', 'I8'] and h['a'].dtype == 'F32' and len(h.infos()) == 2\n"
        "    info = engine.read_checkpoint_info(P)\n"
        "    assert [t.name for _, t in info.tensors()] == h.offset_keys() == ['a', 'b'], info.tensors()\n"
        "    assert h.parameters() == info.parameters() == {'F32': 6, 'I8': 4, 'total': 10}, h.parameters()\n"
        "    assert repr(f).split()[2] == 'numpy', repr(f)\n",
        ("numpy",),
        setup="import engine\n",
        then="with engine.safe_open(P, framework='np') as f:\n"
             "    assert f.get_tensor('a').sum() == 15.0\n"
             "h = engine.read_header(P)\n"
             "assert not h.table.codes.flags.writeable and len(h.table.order) == 2\n",
        present=("numpy",),
    ),
    "engine inspect": Case(
        "from engine.commands.cli import main\n"
        "assert main(['inspect', P]) == 0\n",
        ("numpy", "dataclasses", "statistics", "inspect"),
    ),
    "numpy dtypes, then BF16": Case(
        "from engine.base import dtypes\n"
        "a = [str(dtypes.numpy_dtype(dtypes.BY_NAME[n].code)) for n in ('F32', 'I64', 'BOOL', 'F4', 'C64')]\n"
        "assert a == ['float32', 'int64', 'bool', 'uint8', 'complex64'], a\n",
        ("ml_dtypes",),
        then="from engine.base import dtypes\n"
             "assert str(dtypes.numpy_dtype(dtypes.BY_NAME['BF16'].code)) == 'bfloat16'\n",
        present=("ml_dtypes",),
    ),
    "statistics and quantize": Case(
        "import engine.statistics, engine.quantize\n",
        ("engine.checkpoints.checkpoint", "engine.loading.file_handle", "engine.loading.loader", "torch"),
        needs="numba",
    ),
    "engine.stats on numpy": Case(
        "import numpy as np\n"
        "engine.stats(np.ones(3, np.float32))\n",
        ("torch",),
        setup="import engine\n",
        needs="numba",
    ),
    "a plain load, then a quantizing one": Case(
        "n = sum(1 for _ in engine.stream(P, framework='np', device='cpu'))\n"
        "assert n == 2, n\n",
        ("numba",),
        setup="import engine\n",
        then="list(engine.stream(P, framework='np', device='cpu', quantize='int8', names=['a']))\n",
        present=("numba",),
        needs="numba",
    ),
    "saving numpy arrays": Case(
        "import numpy as np, engine.writing.writer as w\n"
        "w.save({'a': np.zeros(2), 'b': np.zeros(3, dtype='>f4')})\n",
        ("torch",),
    ),
}


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("imports") / "a.safetensors"
    engine.numpy.save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int8)}, str(path),
                           metadata={"k": "v"})
    return str(path)


def _script(case: Case, path: str) -> str:
    def loaded(names) -> str:
        return (f"sorted(n for n in {tuple(names)!r} if any(m == n or m.startswith(n + '.') for m in "
                "set(sys.modules) - before))")

    return "\n".join([
        "import sys", f"P = {path!r}", case.setup,
        "before = set(sys.modules)", case.code, f"print({loaded(case.absent)})",
        "before = set()", case.then, f"print({loaded(case.present)})",
    ])


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_entry_point_imports_only_what_it_needs(case, small_file):
    if case.needs:
        pytest.importorskip(case.needs, reason=f"{case.needs} is an optional extra")
    absent, present = run_python(_script(case, small_file)).strip().splitlines()[-2:]
    assert absent == "[]", f"imported: {absent}"
    assert present == str(sorted(case.present)), f"not imported: {case.present} ({present})"


def test_the_table_can_fail(small_file):
    """A case whose code imports a listed module is caught (the table is not vacuous)."""
    bad = Case("import json\n", ("json",), then="import numpy\n", present=("numpy",))
    absent, present = run_python(_script(bad, small_file)).strip().splitlines()[-2:]
    assert absent == "['json']" and present == "['numpy']"


#: the standard library a first open may use (each imported by the child before it starts
#: counting, with what it imports in turn): anything else it imports is a failure
_STDLIB_ALLOWED = ("__future__", "importlib", "os", "typing", "weakref")
#: what ``import engine`` may import, then a first local safe_open with every name, dtype,
#: shape and the metadata, then (numpy imported) its first array; the Cython runtime's own
#: modules aside.  Each module costs a short-lived process its finding, loading and running
#: (docs/first_open.md): the first open goes through four packages, two Python modules and the
#: header extension, and creates none of the error hierarchy's classes; nor does its first array.
ALLOWED = {
    "import engine": ("engine",),
    "first safe_open": ("engine.apps", "engine.apps.opener", "engine.format", "engine.format._header",
                        "engine.loading", "engine.loading.file_handle"),
    "first array": ("engine.base", "engine.base._dtype_rows", "engine.base._files", "engine.base.dtypes",
                    "engine.format.verification", "engine.loading.handle_reads",
                    "engine.sinks", "engine.sinks.numpy", "mmap"),
}
_STEPS = {
    "import engine": "import engine\n",
    "first safe_open": "f = engine.safe_open(P, framework='np')\n"
                       "rows = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]\n"
                       "assert rows == [('a', 'F32', [2, 3]), ('b', 'I8', [4])] and f.metadata() == {'k': 'v'}\n",
    "first array": "import numpy\nstep = set(sys.modules)\nassert f.get_tensor('a').sum() == 15.0\n",
}


def _new_modules(path: str) -> dict[str, list[str]]:
    lines = ["import sys", f"import {', '.join(_STDLIB_ALLOWED)}", f"P = {path!r}"]
    for code in _STEPS.values():
        if "step = " not in code:
            lines.append("step = set(sys.modules)")
        lines += [code, "print(' '.join(sorted(m for m in set(sys.modules) - step "
                        "if not m.startswith('_cython_') and m != 'cython_runtime')))"]
    out = run_python("\n".join(lines)).splitlines()[-len(_STEPS):]
    return {name: line.split() for name, line in zip(_STEPS, out, strict=True)}


def test_a_first_open_imports_only_the_allowed_modules(small_file):
    """``import engine``, a first local ``safe_open`` (names, dtypes, shapes, metadata) and its
    first numpy array import nothing beyond the list kept here: no checksum, reader, planner,
    remote, kernel, writer or CLI module, and no standard-library module past the few listed."""
    got = _new_modules(small_file)
    for step, allowed in ALLOWED.items():
        assert set(got[step]) <= set(allowed), f"{step} imported {sorted(set(got[step]) - set(allowed))}"
    assert set(got["import engine"]) == {"engine"}, got


def test_every_root_name_is_listed_and_resolves():
    """What loads on first use is still there: every name of ``engine.__all__`` is in
    ``dir(engine)`` and resolves (the kernels' names where the kernels extra is installed), and
    nothing lazily resolved is missing from ``__all__``."""
    code = ("import engine, importlib.util\n"
            "kernels = importlib.util.find_spec('numba') is not None\n"
            "names = [n for n in engine.__all__ if kernels or engine._LAZY.get(n) not in "
            "('engine.statistics', 'engine.quantize', 'engine.apps.checkpoint_stats', 'engine.apps.quantized_format', "
            "'engine.apps.validator')]\n"
            "assert set(engine.__all__) <= set(dir(engine)) and set(engine._LAZY) <= set(engine.__all__)\n"
            "bad = [n for n in names if getattr(engine, n) is None]\n"
            "print(len(names), bad)\n")
    count, bad = run_python(code).split(maxsplit=1)
    assert int(count) >= 40 and bad.strip() == "[]", (count, bad)
