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


def test_missing_dependency_names_the_extra():
    err = errors.MissingDependencyError("torch", "torch", "torch tensors")
    assert isinstance(err, ImportError)
    assert "safetensors-engine[torch]" in str(err) and err.name == "torch"


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
