"""The package's layering: data flows one way, and so do imports.

Every module lives in a layer (a package of ``engine/``, or a public module at the root)
and has its layer's floor; a module imports only modules on its own floor or below, at the
top of the file or inside a function alike (a function-level import that climbs a floor is
a cycle in disguise), and the import graph has no cycle.  An import counts however it is
written: ``from engine import name`` reaches the module that defines ``name`` (the package
root's lazy table), ``importlib.import_module``/``__import__`` with a literal name reach that
module and with a computed one count as the top floor, and a Cython source's Python imports
count at any indentation.  Imports between two layers of one floor are listed in
``SAME_FLOOR`` (inside one layer they are free).  A new module goes into a layer's package;
a new layer must be given a floor here, which is the moment to decide where it belongs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from conftest import run_python

import engine

PACKAGE = pathlib.Path(engine.__file__).parent

#: floor of every layer, lowest first (see STYLE: header -> plan -> reader/pipeline ->
#: sinks -> kernels, with the applications above).  A layer is a package of ``engine/`` (its
#: modules share its floor and import each other freely) or a public module at the root.
FLOORS: dict[str, int] = {
    # the vocabulary everything shares, and system plumbing (files, atomic creation, threads)
    "errors": 0,
    "base": 0,
    # bytes <-> validated table
    "format": 1,
    # which byte ranges to read
    "planning": 2,
    # reads: local files (threads, preadv, mappings) and HTTP/S3 ranges
    "io": 3,
    "net": 3,
    # file -> device: the native chunk ring
    "gpu": 4,
    # destinations, and the kernels that run where the bytes land (with their public modules)
    "sinks": 5,
    "numerics": 5,
    "device": 5,
    "statistics": 5,
    "quantize": 5,
    # one file: the handle, the loads, the writer
    "loading": 6,
    "writing": 6,
    # several files as one checkpoint
    "checkpoints": 7,
    # checkpoints behind a URL
    "urls": 8,
    # what is built on opening anything: safe_open, the validator, statistics, int8 files
    "apps": 9,
    # tensor-parallel loads and the framework modules
    "parallel": 10,
    "numpy": 10,
    "torch": 10,
    "distributed": 11,
    # the outermost shells
    "commands": 12,
    # inference servers' loaders (vLLM, SGLang), built on the whole engine
    "serving": 12,
    "compat": 12,
    "__main__": 12,
}

#: the root of ``engine/`` holds the public face only: the package, the framework modules and
#: the public modules the README documents; everything else lives in a layer's package
ROOT_MODULES = {"__main__", "errors", "device", "statistics", "quantize", "numpy", "torch", "distributed", "compat"}


def layer(name: str) -> str:
    return name.split(".")[0]


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
        elif isinstance(node, ast.ImportFrom) and node.module and (node.level == 1 or node.module.startswith("engine.")):
            module = node.module[len("engine."):] if node.level == 0 else node.module
            out.update({a.asname or a.name: module for a in node.names})
    return out


ROOT_NAMES = _root_names()
MODULES = _modules()


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
    """What ``from engine import name`` reaches: a module or package, a public name's module, or the root."""
    if name in MODULES or name in FLOORS:
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
                    found.add(cand if cand in MODULES else mod)
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            if target is not None:
                found.add(target)
    return {m for m in found if m}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    return imports_of(name, path.read_text(), is_package=path.name == "__init__.py", cython=path.suffix == ".pyx")


def floor_of(target: str) -> int:
    return TOP if target in (ROOT, DYNAMIC) else FLOORS[layer(target)]


def climbing(name: str, targets: set[str]) -> list[str]:
    """The imports of ``name`` above its floor (the root and computed names count as the top)."""
    return sorted(t for t in targets if (layer(t) in FLOORS or t in (ROOT, DYNAMIC)) and floor_of(t) > floor_of(name))


#: the imports allowed between two layers of one floor (inside one layer imports are free):
#: every other same-floor edge is a decision, written here, so that (say) a sink never
#: quietly starts to import a kernel
SAME_FLOOR: set[tuple[str, str]] = {
    ("base", "errors"),
    ("device", "numerics"), ("quantize", "numerics"), ("statistics", "numerics"),
    ("__main__", "commands"),
}


def same_floor_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports between two layers of one floor, as (layer, layer)."""
    return {(layer(n), layer(t)) for n, targets in graph.items() for t in targets
            if layer(t) in FLOORS and layer(t) != layer(n) and floor_of(t) == floor_of(n)}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items() if layer(name) in FLOORS}


def test_every_module_has_a_floor():
    assert sorted(m for m in MODULES if layer(m) not in FLOORS) == [], "give each new layer a floor in FLOORS"
    assert sorted(set(FLOORS) - {layer(m) for m in MODULES}) == [], "FLOORS names layers that no longer exist"


def test_the_root_holds_the_public_face_only():
    root = {m for m in MODULES if "." not in m and not (PACKAGE / m).is_dir()}
    assert root == ROOT_MODULES, "put an internal module in its layer's package"
    assert len(root) + 1 <= 12  # with __init__


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_never_climb(name):
    up = climbing(name, GRAPH[name])
    assert up == [], f"engine.{name} (floor {floor_of(name)}) imports higher floors: {up}"


def test_same_floor_imports_are_the_listed_ones():
    edges = same_floor_edges(GRAPH)
    assert sorted(edges - SAME_FLOOR) == [], "an import within one floor: list it in SAME_FLOOR or move a module"
    assert sorted(SAME_FLOOR - edges) == [], "SAME_FLOOR lists imports that no longer exist"


#: private native modules and the one public module that wraps each
NATIVE_OWNERS = {"base._crc32c": "format.checksums", "format._header": "format.header",
                 "io._io": "io.reader", "io._guard": "io.reader", "io._split": "io.reader", "io._pages": "io.reader",
                 "io._spans": "io.reader", "gpu._cudart": "gpu.cudart", "gpu._chunk_plan": "gpu.chunk_plan",
                 "gpu._copy_loop": "gpu._ring", "gpu._ring": "gpu.rings"}


#: the imports of a private native module past its public one, each with its reason
NATIVE_DIRECT = {
    # a first open: the handle's open, header read and per-name lookups are the extension's, so
    # that a short-lived process loads no format.header (docs/first_open.md)
    ("loading.file_handle", "format._header"),
    # the verify flag lives in the extension, where that first open reads it
    ("format.verification", "format._header"),
}


def test_private_native_modules_are_reached_through_their_public_module():
    reached = sorted((name, t) for name, targets in GRAPH.items() for t in targets
                     if t in NATIVE_OWNERS and name not in (t, NATIVE_OWNERS[t]))
    assert reached == sorted(NATIVE_DIRECT), \
        f"import the public module instead (header, reader, rings, cudart, chunk_plan): {reached}"


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
    order = sorted((n for n in GRAPH if n != "__main__"), key=lambda n: (floor_of(n), n))  # __main__ runs the CLI
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
    src = PACKAGE / "loading" / "handle_reads.py"
    # both imported inside functions
    assert "planning.plan" in GRAPH["loading.handle_reads"] and "io.reader" in GRAPH["loading.handle_reads"]
    assert "loading.loader" in _imports("loading.handle_reads", src)


#: planted violations in a floor-1 module (``format.header``): each source climbs to a floor above
PLANTED = {
    "root name inside a function": "def f():\n    from engine import open_checkpoint\n    return open_checkpoint\n",
    "relative root name": "def f():\n    from .. import stream\n    return stream\n",
    "bare package": "def f():\n    import engine\n    return engine.load_file\n",
    "importlib": "import importlib\n\ndef f():\n    return importlib.import_module('engine.checkpoints.checkpoint')\n",
    "importlib, relative": "from importlib import import_module\nm = import_module('.loading.loader', package='engine')\n",
    "importlib, computed": "import importlib\n\ndef f(n):\n    return importlib.import_module('engine.' + n)\n",
    "__import__": "def f():\n    return __import__('engine.distributed')\n",
}


@pytest.mark.parametrize("source", PLANTED.values(), ids=PLANTED.keys())
def test_checker_catches_planted_climbs(source):
    found = imports_of("format.header", source)
    assert climbing("format.header", found) != [], found
    assert climbing("commands.cli", found) == []  # the same imports are fine from the top floor


def test_checker_sees_indented_imports_in_cython_sources():
    source = (
        "# cython: language_level=3\n"
        "from libc.stdint cimport uint64_t\n"
        "cdef int f():\n"
        "    from ..checkpoints.checkpoint import open_checkpoint\n"
        "    import engine.loading.loader as loader\n"
        "    from ..planning.plan import (\n"
        "        select_rows,\n"
        "    )\n"
        '    """from the docstring, not an import"""\n'
        "    return 0\n"
    )
    found = imports_of("format._header", source, cython=True)
    assert found == {"checkpoints.checkpoint", "loading.loader", "planning.plan"}
    assert climbing("format._header", found) == ["checkpoints.checkpoint", "loading.loader", "planning.plan"]


def test_checker_catches_a_planted_same_floor_import():
    """A sink importing a kernel (both floor 5) is not in SAME_FLOOR: the guard names it."""
    graph = {**GRAPH, "sinks.torch": GRAPH["sinks.torch"] | imports_of("sinks.torch", "from ..numerics.statistics import stats\n")}
    assert same_floor_edges(graph) - SAME_FLOOR == {("sinks", "numerics")}
    # inside one layer its modules import each other freely
    assert ("sinks", "sinks") not in same_floor_edges(GRAPH)
    assert "gpu._ring" in GRAPH["gpu.rings"]


def test_the_package_root_resolves_to_the_defining_module():
    assert imports_of("planning.plan", "from engine import stream, SafetensorError, io\n") == {"apps.entry_points", "errors", "io"}
    assert imports_of("planning.plan", "from engine.io import reader\n") == {"io.reader"}
    assert imports_of("planning.plan", "from engine import no_such_name\n") == {ROOT}
