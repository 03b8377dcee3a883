"""The package's layering: data flows one way, and so do imports.

Every module has a floor; a module imports only modules on its own floor or below, at the
top of the file or inside a function alike (a function-level import that climbs a floor is
a cycle in disguise), and the import graph has no cycle.  An import counts however it is
written: ``from engine import name`` reaches the module that defines ``name`` (the package
root's lazy table), ``importlib.import_module``/``__import__`` with a literal name reach that
module and with a computed one count as the top floor, and a Cython source's Python imports
count at any indentation.  Imports between two modules of one floor are listed in
``SAME_FLOOR`` (inside one subpackage they are free).  A new module must be given a floor
here, which is the moment to decide where it belongs.
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
    "_threads": 0,
    "_s3": 0,
    # bytes -> validated table
    "_header": 1,
    "header": 1,
    "_header_encode": 1,
    "_file_handle": 1,
    "checkpoint_index": 1,
    # which byte ranges to read
    "plan": 2,
    "sharding_plan": 2,
    # threads and reads
    "_io": 3,
    "reader": 3,
    "pipeline": 3,
    "device_load": 3,
    "device_ring": 3,
    "_ring": 3,
    "device_units": 3,
    "device_staging": 3,
    "kept_mappings": 3,
    "remote_reads": 3,
    # destinations and the kernels that run where the bytes land
    "sinks": 4,
    "sinks._host": 4,
    "sinks._cudart": 4,
    "sinks._staging": 4,
    "sinks._targets": 4,
    "sinks.numpy": 4,
    "sinks.torch": 4,
    "sinks._torch_fill": 4,
    "sinks.cupy": 4,
    # numerics: the kernels and what is built on them (one subpackage), and the public
    # modules that re-export it
    "numerics": 4,
    "numerics.kernels": 4,
    "numerics._arrays": 4,
    "numerics.cuda_kernels": 4,
    "numerics.device": 4,
    "numerics._device_fallback": 4,
    "numerics.statistics": 4,
    "numerics.quantize": 4,
    "device": 4,
    "statistics": 4,
    "quantize": 4,
    # tensors as bytes for the writer (sinks make tensors out of bytes)
    "_tensor_bytes": 4,
    # one file: the drop-in API, the loaders, the writer
    "file_handle": 5,
    "loader": 5,
    "load_hooks": 5,
    "writer": 5,
    "tensorspec": 5,
    # several files as one checkpoint
    "checkpoint": 6,
    "checkpoint_info": 6,
    "shards": 6,
    "_remote_files": 6,
    "remote_cache": 6,
    # applications; the framework modules take a file or a whole checkpoint
    "opener": 7,
    "numpy": 7,
    "torch": 7,
    "remote": 7,
    "remote_load": 7,
    "remote_handle": 7,
    "tp_remote": 7,
    "distributed": 7,
    "tp_slices": 7,
    "tp_direct": 7,
    "tp_broadcast": 7,
    "validator": 7,
    "checkpoint_stats": 7,
    "quantized_format": 7,
    # the outermost shells
    "compat": 8,
    "demo": 8,
    "cli": 8,
    "_cli_output": 8,
    "_cli_convert": 8,
    "_cli_bench": 8,
    "__main__": 8,
    # inference servers' loaders (vLLM, SGLang), built on the whole engine
    "serving": 8,
    "serving.weights": 8,
    "serving.vllm": 8,
    "serving.sglang": 8,
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


#: the floor of whatever can reach every module: the package root (its lazy names import
#: anything), and a module name only known when the code runs
TOP = max(FLOORS.values())
ROOT = "<engine>"
DYNAMIC = "<dynamic>"


def _root_names() -> dict[str, str]:
    """Public name of the package root -> the module that defines it (the lazy table of
    ``engine/__init__.py``, read from its source; the exceptions come from ``errors``; the
    root's own constants map to ``""``, no module)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            out.update({k: v[len("engine."):] for k, v in ast.literal_eval(node.value).items()})
        elif isinstance(node, ast.Assign):  # the root's own constants (``__version__``): no import
            out.update({t.id: "" for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.update({a.asname or a.name: node.module for a in node.names})
    return out


ROOT_NAMES = _root_names()


def _pyx_python_imports(source: str) -> str:
    """The Python ``import`` statements of a Cython source at any indentation (a function's
    own imports included), dedented, one per line; ``cimport`` lines are Cython's and left
    out, and a line that only looks like an import (prose in a docstring) is dropped."""
    out, lines, i = [], source.splitlines(), 0
    while i < len(lines):
        stmt = lines[i].strip()
        i += 1
        if not stmt.startswith(("import ", "from ")) or " cimport " in stmt:
            continue
        while (stmt.count("(") > stmt.count(")") or stmt.endswith("\\")) and i < len(lines):
            stmt = stmt.rstrip("\\") + " " + lines[i].strip()
            i += 1
        try:
            ast.parse(stmt)
        except SyntaxError:
            continue
        out.append(stmt)
    return "\n".join(out)


def _resolve_root(name: str) -> str:
    """What ``from engine import name`` reaches: a module, a public name's module, or the root."""
    if name in FLOORS:
        return name
    return ROOT_NAMES.get(name, ROOT)


def _dynamic_target(call: ast.Call) -> str | None:
    """The engine module an ``importlib.import_module``/``__import__`` call imports, ROOT for
    the package itself, DYNAMIC when the name is computed, None for another package."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return DYNAMIC
    target = arg.value
    if target.startswith("."):
        anchor = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
        if not (isinstance(anchor, ast.Constant) and isinstance(anchor.value, str)):
            return DYNAMIC
        target = anchor.value + target
    if target == "engine":
        return ROOT
    if target.startswith("engine."):
        return target[len("engine."):]
    return None


def imports_of(name: str, source: str, *, is_package: bool = False, cython: bool = False) -> set[str]:
    """Engine modules that module ``name`` imports anywhere in ``source``: at the top, inside
    functions, through the package root (``from engine import stream`` reaches ``loader``),
    and through ``importlib`` (a computed name is :data:`DYNAMIC`).  Cython sources: their
    Python imports only, at any indentation."""
    if cython:
        source = _pyx_python_imports(source)
    tree = ast.parse(source)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "engine":
                    found.add(ROOT)
                elif alias.name.startswith("engine."):
                    found.add(alias.name[len("engine.") :])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join([*base, node.module] if node.module else base)
            elif node.module == "engine":
                mod = ""
            elif node.module and node.module.startswith("engine."):
                mod = node.module[len("engine.") :]
            else:
                continue
            for alias in node.names:
                if not mod:
                    found.add(_resolve_root(alias.name))
                else:
                    cand = f"{mod}.{alias.name}"
                    found.add(cand if cand in FLOORS else mod)
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            if target is not None:
                found.add(target)
    return {m for m in found if m}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    return imports_of(name, path.read_text(), is_package=path.name == "__init__.py", cython=path.suffix == ".pyx")


def floor_of(target: str) -> int:
    return TOP if target in (ROOT, DYNAMIC) else FLOORS[target]


def climbing(name: str, targets: set[str]) -> list[str]:
    """The imports of ``name`` above its floor (the root and computed names count as the top)."""
    return sorted(t for t in targets if (t in FLOORS or t in (ROOT, DYNAMIC)) and floor_of(t) > FLOORS[name])


#: the imports allowed between different modules of one floor, beside those inside one
#: subpackage (``sinks.torch`` -> ``sinks._cudart``): every other same-floor edge is a
#: decision, written here, so that (say) a sink never quietly starts to import a kernel
SAME_FLOOR: set[tuple[str, str]] = {
    ("_atomic", "errors"), ("_files", "errors"), ("_http", "errors"), ("dtypes", "errors"), ("_s3", "errors"),
    ("header", "_header"), ("_header_encode", "header"), ("checkpoint_index", "header"),
    ("pipeline", "reader"), ("reader", "_io"), ("pipeline", "device_load"), ("device_load", "reader"), ("device_load", "device_units"),
    ("device_load", "device_staging"), ("reader", "kept_mappings"), ("pipeline", "device_ring"),
    ("device_ring", "reader"), ("device_ring", "_ring"), ("device_staging", "device_ring"),
    ("device", "numerics.device"), ("quantize", "numerics.quantize"), ("statistics", "numerics.statistics"),
    ("file_handle", "loader"), ("loader", "load_hooks"), ("tensorspec", "writer"),
    ("checkpoint", "shards"), ("checkpoint", "checkpoint_info"), ("_remote_files", "checkpoint_info"),
    ("distributed", "tp_broadcast"), ("distributed", "tp_direct"), ("tp_direct", "tp_slices"),
    ("tp_broadcast", "tp_slices"), ("tp_direct", "opener"), ("tp_broadcast", "opener"), ("tp_slices", "opener"),
    ("numpy", "opener"), ("torch", "opener"),
    ("remote_load", "remote"), ("opener", "remote_load"), ("opener", "remote_handle"), ("opener", "remote"),
    # the commands' modules open checkpoints as engine.open_checkpoint does: a path or a URL
    ("checkpoint_stats", "opener"), ("quantized_format", "opener"), ("validator", "opener"),
    ("remote_handle", "remote_load"), ("distributed", "tp_remote"), ("tp_remote", "remote_handle"),
    ("tp_remote", "remote_load"), ("tp_remote", "tp_direct"), ("tp_remote", "tp_slices"), ("torch", "remote_load"), ("numpy", "remote_load"),
    ("__main__", "cli"), ("cli", "demo"),
    ("cli", "_cli_output"), ("cli", "_cli_convert"), ("cli", "_cli_bench"),
    ("_cli_convert", "_cli_output"), ("_cli_bench", "_cli_output"),
}


def same_floor_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports between two modules of one floor that are not in one subpackage."""
    return {(n, t) for n, targets in graph.items() for t in targets
            if t in FLOORS and t != n and FLOORS[t] == FLOORS[n] and n.split(".")[0] != t.split(".")[0]}


MODULES = _modules()
GRAPH = {name: _imports(name, path) for name, path in MODULES.items() if name in FLOORS}


def test_every_module_has_a_floor():
    assert sorted(set(MODULES) - set(FLOORS)) == [], "give each new module a floor in FLOORS"
    assert sorted(set(FLOORS) - set(MODULES)) == [], "FLOORS names modules that no longer exist"


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_never_climb(name):
    up = climbing(name, GRAPH[name])
    assert up == [], f"engine.{name} (floor {FLOORS[name]}) imports higher floors: {up}"


def test_same_floor_imports_are_the_listed_ones():
    edges = same_floor_edges(GRAPH)
    assert sorted(edges - SAME_FLOOR) == [], "an import within one floor: list it in SAME_FLOOR or move a module"
    assert sorted(SAME_FLOOR - edges) == [], "SAME_FLOOR lists imports that no longer exist"


#: private native modules and the one public module that wraps each
NATIVE_OWNERS = {"_header": "header", "_file_handle": "file_handle", "_io": "reader", "_ring": "device_ring"}


def test_private_native_modules_are_reached_through_their_public_module():
    reached = sorted((name, t) for name, targets in GRAPH.items() for t in targets
                     if t in NATIVE_OWNERS and name not in (t, NATIVE_OWNERS[t]))
    assert reached == [], f"import the public module instead (header, file_handle, reader): {reached}"


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
    src = PACKAGE / "file_handle.py"
    assert "plan" in GRAPH["file_handle"] and "reader" in GRAPH["file_handle"]  # both imported inside functions
    assert "loader" in _imports("file_handle", src)


#: planted violations in a floor-1 module (``header``): each source climbs to a floor above
PLANTED = {
    "root name inside a function": "def f():\n    from engine import open_checkpoint\n    return open_checkpoint\n",
    "relative root name": "def f():\n    from . import stream\n    return stream\n",
    "bare package": "def f():\n    import engine\n    return engine.load_file\n",
    "importlib": "import importlib\n\ndef f():\n    return importlib.import_module('engine.checkpoints.checkpoint')\n",
    "importlib, relative": "from importlib import import_module\nm = import_module('.loader', package='engine')\n",
    "importlib, computed": "import importlib\n\ndef f(n):\n    return importlib.import_module('engine.' + n)\n",
    "__import__": "def f():\n    return __import__('engine.distributed')\n",
}


@pytest.mark.parametrize("source", PLANTED.values(), ids=PLANTED.keys())
def test_checker_catches_planted_climbs(source):
    found = imports_of("header", source)
    assert climbing("header", found) != [], found
    assert climbing("cli", found) == []  # the same imports are fine from the top floor


def test_checker_sees_indented_imports_in_cython_sources():
    source = (
        "# cython: language_level=3\n"
        "from libc.stdint cimport uint64_t\n"
        "cdef int f():\n"
        "    from .checkpoint import open_checkpoint\n"
        "    import engine.loading.loader as loader\n"
        "    from .plan import (\n"
        "        select_rows,\n"
        "    )\n"
        '    """from the docstring, not an import"""\n'
        "    return 0\n"
    )
    found = imports_of("_header", source, cython=True)
    assert found == {"checkpoint", "loader", "plan"}
    assert climbing("_header", found) == ["checkpoint", "loader", "plan"]


def test_checker_catches_a_planted_same_floor_import():
    """A sink importing a kernel (both floor 4) is not in SAME_FLOOR: the guard names it."""
    graph = {**GRAPH, "sinks.torch": GRAPH["sinks.torch"] | imports_of("sinks.torch", "from ..numerics.statistics import stats\n")}
    assert same_floor_edges(graph) - SAME_FLOOR == {("sinks.torch", "numerics.statistics")}
    # inside one subpackage the floor's modules import each other freely
    assert ("sinks.torch", "sinks._cudart") not in same_floor_edges(GRAPH)


def test_the_package_root_resolves_to_the_defining_module():
    assert imports_of("plan", "from engine import stream, SafetensorError, reader\n") == {"opener", "errors", "reader"}
    assert imports_of("plan", "from engine import no_such_name\n") == {ROOT}
