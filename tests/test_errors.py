"""The error hierarchy: builtin bases, reasons, paths, pickling."""

from __future__ import annotations

import pickle

import pytest

from engine import errors


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (errors.HeaderError, ValueError),
        (errors.TensorNotFoundError, KeyError),
        (errors.SerializationError, ValueError),
        (errors.ReadError, OSError),
        (errors.WriteError, OSError),
        (errors.DeviceError, RuntimeError),
    ],
)
def test_every_error_is_also_the_builtin_callers_catch(cls, builtin):
    assert issubclass(cls, errors.SafetensorError)
    assert issubclass(cls, builtin)


def test_message_names_file_reason_and_survives_pickling():
    err = errors.HeaderError("tensor 'a' overlaps 'b'", reason="InvalidOffset", position=12, tensors=("a", "b"))
    err.path = "/m/model.safetensors"
    text = str(err)
    assert text.startswith("/m/model.safetensors: ") and "InvalidOffset" in text and "'a'" in text
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.HeaderError
    assert (back.reason, back.position, back.tensors, back.path, str(back)) == (
        "InvalidOffset", 12, ("a", "b"), "/m/model.safetensors", text)


def test_key_error_message_is_not_quoted():
    err = errors.TensorNotFoundError("no tensor 'x'", path="f.safetensors")
    assert str(err) == "f.safetensors: no tensor 'x'"


def test_read_error_carries_offset_and_size():
    err = errors.ReadError("short", offset=10, size=20, path="p")
    assert (err.offset, err.size) == (10, 20)


def test_missing_dependency_names_the_feature_the_package_and_the_install_line():
    err = errors.MissingDependencyError("torch", "torch", "torch tensors")
    assert isinstance(err, ModuleNotFoundError) and isinstance(err, errors.SafetensorError)
    assert (err.name, err.extra, err.feature) == ("torch", "torch", "torch tensors")
    assert str(err).startswith("torch tensors needs torch") and errors.install_line("torch") in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.name, back.extra, str(back)) == (type(err), "torch", "torch", str(err))


def test_the_install_line_has_the_checkouts_form_in_a_checkout(tmp_path, monkeypatch):
    """The hint named `pip install safetensors-engine[kernels]`, which is not how a checkout
    installs (the README's `pip install -e .`)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(errors.__file__)))
    assert os.path.exists(os.path.join(root, "pyproject.toml"))  # these tests run from a checkout
    monkeypatch.chdir(root)
    assert errors.install_line("kernels") == 'pip install -e ".[kernels]"'
    monkeypatch.chdir(tmp_path)
    assert errors.install_line("kernels") == f'pip install -e "{root}[kernels]"'


def test_an_import_error_of_an_extra_becomes_a_missing_dependency():
    err = errors.MissingDependencyError.of(ModuleNotFoundError("No module named 'llvmlite'", name="llvmlite"),
                                           "engine.stats")
    assert isinstance(err, errors.MissingDependencyError)
    # llvmlite comes with numba: the message names the package the user knows and installs
    assert (err.name, err.extra) == ("numba", "kernels") and "engine.stats needs numba" in str(err)
    assert "llvmlite" not in str(err)
    other = ModuleNotFoundError("No module named 'yaml'", name="yaml")  # not an extra: left alone
    assert errors.MissingDependencyError.of(other, "x") is other


def test_header_reasons_cover_the_reference_names():
    reference = {"HeaderTooSmall", "HeaderTooLarge", "InvalidHeaderLength", "InvalidHeader", "InvalidHeaderStart",
                 "InvalidHeaderDeserialization", "TensorInvalidInfo", "InvalidOffset", "MetadataIncompleteBuffer",
                 "ValidationOverflow", "MisalignedSlice"}
    assert reference <= errors.HEADER_REASONS


def test_every_error_class_lives_in_errors_and_is_exported():
    """One hierarchy: no module defines an error class of its own, and `engine` exports all."""
    import ast
    import pathlib

    import engine
    from engine import errors

    package = pathlib.Path(engine.__file__).parent
    defined_elsewhere = []
    for path in package.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Cancelled")) for b in node.bases
            ):
                if not node.name.startswith("_"):
                    defined_elsewhere.append(f"{path.name}:{node.name}")
    assert defined_elsewhere == []
    classes = [
        v for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, errors.SafetensorError)
    ]
    for cls in classes:
        if cls.__name__.startswith("_"):
            continue
        assert cls.__name__ in errors.__all__, cls
        assert getattr(engine, cls.__name__) is cls, cls


#: each feature that needs an extra, called in a fresh interpreter where the extra's package
#: cannot be imported: (blocked module, code that needs it, the extra)
NEEDS = {
    "stats": ("llvmlite", "engine.stats", "kernels"),
    "quantize_int8": ("numba", "engine.quantize_int8", "kernels"),
    "stats_file": ("numba", "engine.stats_file(P)", "kernels"),
    "WeightValidator": ("numba", "engine.WeightValidator(C)", "kernels"),
    "stream(stats=True)": ("numba", "list(engine.stream(P, framework='np', stats=True))", "kernels"),
    "stream's default framework": ("torch", "list(engine.stream(P))", "torch"),
    "safe_open(framework='pt')": ("torch", "engine.safe_open(P, 'pt')", "torch"),
    # each framework module raises it at its own import, as the README promises
    "import engine.torch": ("torch", "import engine.torch", "torch"),
    "import engine.distributed": ("torch", "import engine.distributed", "torch"),
    "import engine.device": ("numba", "import engine.device", "kernels"),
    "import engine.statistics": ("numba", "import engine.statistics", "kernels"),
    "import engine.quantize": ("numba", "import engine.quantize", "kernels"),
    "import engine.numpy": ("numpy", "import engine.numpy", ""),
}


@pytest.mark.parametrize("what", NEEDS)
def test_a_missing_extra_is_one_error_naming_feature_package_and_install_line(tmp_path, what):
    """engine.stats, quantize_int8, WeightValidator and stream(stats=True) raised a bare
    `No module named 'llvmlite'`, and stream without torch `No module named 'torch'`."""
    import json

    import numpy as np
    from conftest import run_python

    blocked, call, extra = NEEDS[what]
    import engine.numpy

    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(path))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=10)))
    code = (
        "import sys, json\n"
        f"sys.modules[{blocked!r}] = None\n"
        "import engine\n"
        f"P, C = {str(path)!r}, {str(config)!r}\n"
        "try:\n"
        f"    {call}\n"
        "except engine.MissingDependencyError as err:\n"
        "    print(json.dumps([str(err), err.name, err.extra, isinstance(err, ModuleNotFoundError)]))\n"
    )
    message, name, got_extra, is_mnfe = json.loads(run_python(code))
    shown = "numba" if blocked == "llvmlite" else blocked  # (numba brings llvmlite)
    assert (name, got_extra, is_mnfe) == (shown, extra, True)
    assert f"needs {shown}" in message and errors.install_line(extra) in message
    if what == "import engine.torch":
        assert "engine.numpy" in message
    elif extra == "torch" and not what.startswith("import"):
        assert "framework='np'" in message


@pytest.mark.parametrize("command", [["validate", "{dir}"], ["stats", "{file}"], ["quantize", "{file}", "{out}"]])
def test_a_command_without_its_extra_is_one_line_and_exit_2(tmp_path, command):
    """`engine validate model/` beside a config.json printed its "ok" lines, then a traceback
    ending `No module named 'llvmlite'`, exit 1."""
    import json
    import subprocess
    import sys

    import numpy as np

    import engine.numpy

    engine.numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(hidden_size=8, intermediate_size=16,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          vocab_size=10)))
    args = [a.format(dir=tmp_path, file=tmp_path / "model.safetensors", out=tmp_path / "q.safetensors")
            for a in command]
    code = ("import sys\nsys.modules['llvmlite'] = None\nfrom engine.commands.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert f"engine {command[0]}" in out.stderr and "needs numba" in out.stderr
    assert errors.install_line("kernels") in out.stderr

