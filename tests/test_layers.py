"""The package's layering: data flows one way, and so do imports.

Every module has a floor; a module imports only modules on its own floor or below, at the
top of the file or inside a function alike (a function-level import that climbs a floor is
a cycle in disguise), and the import graph has no cycle.  A new module must be given a
floor here, which is the moment to decide where it belongs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from conftest import run_python

import engine

PACKAGE = pathlib.Path(engine.__file__).parent

#: floor of every module, lowest first (see STYLE: header -> plan -> reader/pipeline ->
#: sinks -> kernels, with the applications above)
FLOORS: dict[str, int] = {
    # the vocabulary everything shares
    "errors": 0,
    "dtypes": 0,
    # system plumbing: opening regular files, atomic file creation, an HTTP client
    "_files": 0,
    "_atomic": 0,
    "_http": 0,
    # bytes -> validated table
    "_header": 1,
    "header": 1,
    "_api": 1,
    # which byte ranges to read
    "plan": 2,
    # threads and reads
    "_io": 3,
    "reader": 3,
    "pipeline": 3,
    # destinations and the kernels that run where the bytes land
    "sinks": 4,
    "sinks._host": 4,
    "sinks._cudart": 4,
    "sinks.numpy": 4,
    "sinks.torch": 4,
    "sinks.cupy": 4,
    "kernels": 4,
    "_arrays": 4,
    "cuda_kernels": 4,
    "device": 4,
    "statistics": 4,
    "quantize": 4,
    # one file: the drop-in API, the loaders, the writer
    "api": 5,
    "loader": 5,
    "onload": 5,
    "writer": 5,
    "tensorspec": 5,
    # several files as one checkpoint
    "checkpoint": 6,
    "shards": 6,
    # applications; the framework modules take a file or a whole checkpoint
    "opener": 7,
    "numpy": 7,
    "torch": 7,
    "remote": 7,
    "distributed": 7,
    "validator": 7,
    "filestats": 7,
    "quantized": 7,
    # the outermost shells
    "compat": 8,
    "demo": 8,
    "cli": 8,
    "__main__": 8,
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py*"):
        if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(PACKAGE).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith("__init__"):
            name = name[: -len(".__init__")] if "." in name else ""
        if name:
            out[name] = path
    return out


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Engine modules that ``name`` imports anywhere in its source (Cython: Python imports only)."""
    source = path.read_text()
    if path.suffix == ".pyx":
        lines = [ln for ln in source.splitlines() if ln.startswith(("import ", "from ")) and " cimport " not in ln]
        source = "\n".join(lines)
    tree = ast.parse(source)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("engine."):
                    found.add(alias.name[len("engine.") :])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("engine."):
                mod = node.module[len("engine.") :]
            else:
                continue
            candidates = [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            for cand in candidates:
                found.add(cand if cand in FLOORS else mod)
    return {m for m in found if m}


MODULES = _modules()
GRAPH = {name: _imports(name, path) for name, path in MODULES.items() if name in FLOORS}


def test_every_module_has_a_floor():
    assert sorted(set(MODULES) - set(FLOORS)) == [], "give each new module a floor in FLOORS"
    assert sorted(set(FLOORS) - set(MODULES)) == [], "FLOORS names modules that no longer exist"


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_never_climb(name):
    climbing = sorted(t for t in GRAPH[name] if t in FLOORS and FLOORS[t] > FLOORS[name])
    assert climbing == [], f"engine.{name} (floor {FLOORS[name]}) imports higher floors: {climbing}"


#: private native modules and the one public module that wraps each
NATIVE_OWNERS = {"_header": "header", "_api": "api", "_io": "reader"}


def test_private_native_modules_are_reached_through_their_public_module():
    reached = sorted((name, t) for name, targets in GRAPH.items() for t in targets
                     if t in NATIVE_OWNERS and name not in (t, NATIVE_OWNERS[t]))
    assert reached == [], f"import the public module instead (header, api, reader): {reached}"


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt not in GRAPH:
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [])


def test_modules_import_alone_in_floor_order():
    """Each module imports in a fresh interpreter, lowest floor first (optional frameworks
    that are not installed are skipped)."""
    order = sorted((n for n in GRAPH if n != "__main__"), key=lambda n: (FLOORS[n], n))  # __main__ runs the CLI
    code = (
        "import importlib, sys\n"
        f"for name in {order!r}:\n"
        "    try:\n"
        "        importlib.import_module('engine.' + name)\n"
        "    except ImportError as exc:\n"
        "        if getattr(exc, 'name', None) in ('torch', 'cupy', 'numba', 'tqdm', 'fsspec'):\n"
        "            continue\n"
        "        raise SystemExit(f'engine.{name}: {exc!r}')\n"
    )
    run_python(code)


def test_checker_sees_function_level_imports():
    """The checker is able to fail: a function-level import of a higher floor is found."""
    src = PACKAGE / "api.py"
    assert "plan" in GRAPH["api"] and "reader" in GRAPH["api"]  # both imported inside functions
    assert "loader" in _imports("api", src)


def test_opening_a_file_imports_nothing_it_does_not_need():
    """import engine + a first safe_open of a local file: no HTTP, asyncio, test modules,
    thread pools, kernels, checkpoint code or mmap (tools that open many checkpoints in short-lived processes
    pay for every import)."""
    code = (
        "import sys, engine, numpy as np, tempfile, os\n"
        "d = tempfile.mkdtemp(); p = os.path.join(d, 'a.safetensors')\n"
        "engine.save_file({'a': np.zeros(3, np.float32)}, p)\n"
        "before = set(sys.modules)\n"
        "with engine.safe_open(p, framework='np') as f:\n"
        "    [f.get_slice(k).get_shape() for k in f.keys()]\n"
        "new = set(sys.modules) - before\n"
        "bad = sorted(m for m in new if m.split('.')[0] in ('urllib', 'http', 'asyncio', 'unittest', 'ssl', "
        "'email', 'certifi', 'concurrent', 'numba', 'torch', 'queue', 'json') or m in ('engine.loader', 'engine.pipeline', "
        "'engine.remote', 'engine.statistics', 'engine.kernels', 'engine.checkpoint', 'mmap'))\n"
        "print(bad)\n"
    )
    assert run_python(code).strip() == "[]"


def test_reading_headers_imports_no_numpy(tmp_path):
    """Names, dtypes, shapes, metadata, file order and parameter counts, through safe_open,
    read_header and read_checkpoint_info (``engine inspect``), import no numpy (a tool that
    inspects headers never pays for it); the first array does."""
    import numpy as np

    import engine

    p = tmp_path / "a.safetensors"
    engine.save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int8)}, str(p),
                     metadata={"k": "v"})
    code = (
        "import sys, engine\n"
        f"p = {str(p)!r}\n"
        "with engine.safe_open(p, framework='np') as f:\n"
        "    rows = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]\n"
        "    md = f.metadata()\n"
        "    h = engine.read_header(p)\n"
        "    infos = [h[k] for k in h] + h.infos()\n"
        "    info = engine.read_checkpoint_info(p)\n"
        "    assert [t.name for _, t in info.tensors()] == h.offset_keys() == ['a', 'b'], info.tensors()\n"
        "    assert h.parameters() == info.parameters() == {'F32': 6, 'I8': 4, 'total': 10}, h.parameters()\n"
        "    print(rows, md, h.dtypes, infos[0].dtype, repr(f).split()[2])\n"
        "    print('numpy' in sys.modules)\n"
        "    a = f.get_tensor('a')\n"
        "    print('numpy' in sys.modules, a.sum(), h.table.codes.tolist(), h.table.order.tolist())\n"
    )
    first, before, after = run_python(code).strip().splitlines()
    assert first == ("[('a', 'F32', [2, 3]), ('b', 'I8', [4])] {'k': 'v'} ['F32', 'I8'] F32 numpy")
    assert before == "False"
    h = engine.read_header(str(p))  # here numpy is imported: the columns as arrays
    codes = [engine.dtypes.BY_NAME["F32"].code, engine.dtypes.BY_NAME["I8"].code]
    assert h.table.codes.tolist() == codes and not h.table.codes.flags.writeable
    assert after == f"True 15.0 {codes} {h.table.order.tolist()}"
