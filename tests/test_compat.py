"""engine.compat: ``import safetensors`` resolving to the engine, and putting back what was there.

Tests that change ``sys.modules`` in this process leave it as they found it (the
``restores_modules`` fixture checks); the cases that need a process where the reference was
never imported, and the real clients (transformers, accelerate), run in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import run_python, write_raw

import engine
import engine.compat as compat
import engine.numpy

ROOT = Path(__file__).resolve().parent.parent


def _owned(name: str) -> bool:
    return name == "safetensors" or name.startswith("safetensors.")


def _snapshot() -> dict[str, types.ModuleType]:
    return {name: module for name, module in sys.modules.items() if _owned(name)}


def _run(code: str, *args: str, timeout: float = 300) -> str:
    """Standard output of ``code`` in a fresh interpreter that imports this checkout's engine."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return run_python(textwrap.dedent(code), *args, env=env, timeout=timeout)


@pytest.fixture
def restores_modules():
    """The reference is imported (as most processes that use the shim will have it), and
    this test must leave the ``safetensors`` entries of ``sys.modules`` exactly as found."""
    import safetensors  # noqa: F401  the reference
    import safetensors.numpy  # noqa: F401

    with contextlib.suppress(ImportError):  # needs torch
        import safetensors.torch  # noqa: F401

    before = _snapshot()
    meta_path = list(sys.meta_path)
    yield before
    if compat.is_installed():  # a failing test must not leave the shim behind for the others
        compat.uninstall()
        pytest.fail("the test left the shim installed")
    after = _snapshot()
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert sys.meta_path == meta_path


# -- install, uninstall, installed() ---------------------------------------------------------


def test_install_then_uninstall_puts_back_the_reference(restores_modules):
    reference = restores_modules["safetensors"]
    assert compat.install(warn=False) is True
    assert compat.is_installed()
    assert sys.modules["safetensors"] is not reference
    assert "safetensors.numpy" not in sys.modules  # the reference's, kept aside until uninstall
    import safetensors.numpy

    assert safetensors.numpy is engine.numpy
    assert compat.uninstall() is True
    assert not compat.is_installed()
    assert sys.modules["safetensors"] is reference
    assert sys.modules["safetensors.numpy"] is restores_modules["safetensors.numpy"]
    # the reference's own package was not touched while the shim stood in for it
    assert reference.numpy is restores_modules["safetensors.numpy"]


def test_install_and_uninstall_do_not_nest(restores_modules):
    assert compat.install(warn=False) is True
    shim = sys.modules["safetensors"]
    assert compat.install(warn=False) is False
    assert sys.modules["safetensors"] is shim
    assert sys.meta_path.count(compat._FINDER) == 1
    assert compat.uninstall() is True
    assert compat.uninstall() is False


def test_installed_context_manager_restores_even_on_error(restores_modules):
    with pytest.raises(LookupError, match="inside the block"):
        with compat.installed(warn=False) as shim:
            assert sys.modules["safetensors"] is shim
            import safetensors.torch  # noqa: F401

            assert sys.modules["safetensors.torch"] is sys.modules["engine.torch"]
            raise LookupError("inside the block")
    assert not compat.is_installed()


def test_inner_installed_block_leaves_the_outer_one_in_place(restores_modules):
    with compat.installed(warn=False) as outer:
        with compat.installed(warn=False) as inner:
            assert inner is outer
        assert compat.is_installed()
        assert sys.modules["safetensors"] is outer
    assert not compat.is_installed()


def test_each_install_starts_from_a_fresh_module(restores_modules):
    with compat.installed(warn=False) as first:
        import safetensors.numpy  # noqa: F401

        assert first.numpy is engine.numpy
    with compat.installed(warn=False) as second:
        assert second is not first
        assert "numpy" not in vars(second)
        assert "safetensors.numpy" not in sys.modules


def test_where_the_reference_was_never_imported_uninstall_leaves_nothing():
    # a fresh process: the reference must not be imported before install() for this case
    out = _run(
        """
        import json, sys, warnings
        import engine, engine.compat
        owned = lambda: sorted(m for m in sys.modules if m == "safetensors" or m.startswith("safetensors."))
        facts = {"before": owned(), "torch_after_import": "torch" in sys.modules}
        warnings.simplefilter("error")  # nothing is bound to the reference: install() must not warn
        with engine.compat.installed():
            import safetensors
            facts["torch_after_import_safetensors"] = "torch" in sys.modules
            import safetensors.numpy, safetensors.torch
            facts["inside"] = owned()
            facts["is_engine"] = (safetensors.safe_open is engine.safe_open
                                  and safetensors.torch is sys.modules["engine.torch"])
        facts["after"] = owned()
        import safetensors, safetensors.torch
        facts["reference_after"] = (safetensors.safe_open is not engine.safe_open
                                    and safetensors.torch.__name__ == "safetensors.torch"
                                    and safetensors.__file__ is not None)
        print(json.dumps(facts))
        """
    )
    facts = json.loads(out)
    assert facts == {
        "before": [],
        "torch_after_import": False,
        "torch_after_import_safetensors": False,
        "inside": ["safetensors", "safetensors.numpy", "safetensors.torch"],
        "is_engine": True,
        "after": [],
        "reference_after": True,
    }


# -- what `import safetensors` gives under the shim ------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "safe_open",
        "SafetensorError",
        "serialize",
        "serialize_file",
        "deserialize",
        "TensorSpec",
        "_safe_open_handle",
    ],
)
def test_top_level_names_are_the_engines(restores_modules, name):
    with compat.installed(warn=False):
        import safetensors

        assert getattr(safetensors, name) is getattr(engine, name)
        # `from safetensors import *` gives the public ones, as the reference's does
        assert (name in safetensors.__all__) != name.startswith("_")


def test_submodules_are_the_engines_modules_unchanged(restores_modules):
    with compat.installed(warn=False):
        import safetensors.numpy
        import safetensors.torch
        from safetensors import torch as st_torch

        assert (
            safetensors.torch is st_torch is sys.modules["safetensors.torch"] is sys.modules["engine.torch"]
        )
        assert safetensors.numpy is sys.modules["engine.numpy"]
        # the import system must not rewrite the engine modules' own identity
        assert safetensors.torch.__name__ == "engine.torch"
        assert safetensors.torch.__spec__.name == "engine.torch"
        assert safetensors.numpy.__spec__.name == "engine.numpy"


def test_version_is_the_reference_api_level(restores_modules):
    from packaging.version import Version

    with compat.installed(warn=False):
        import safetensors

        assert safetensors.__version__ == compat.REFERENCE_VERSION
        assert safetensors.__engine_version__ == engine.__version__
        # huggingface_hub refuses anything older than 0.4.3; transformers asks for 0.8
        assert Version(safetensors.__version__) >= Version("0.8")


def test_find_spec_sees_the_shim(restores_modules):
    # huggingface_hub and transformers probe with importlib.util.find_spec
    with compat.installed(warn=False) as shim:
        spec = importlib.util.find_spec("safetensors")
        assert spec is shim.__spec__ and spec.submodule_search_locations == []


def test_import_safetensors_again_after_its_entry_was_dropped(restores_modules):
    with compat.installed(warn=False) as shim:
        del sys.modules["safetensors"]
        import safetensors

        assert safetensors is shim


@pytest.mark.parametrize("sub", ["flax", "tensorflow", "paddle", "mlx", "_safetensors_rust"])
def test_other_submodules_raise_a_clear_import_error(restores_modules, sub):
    with compat.installed(warn=False):
        with pytest.raises(ModuleNotFoundError, match=r"engine\.compat\.uninstall\(\)") as info:
            importlib.import_module(f"safetensors.{sub}")
        assert info.value.name == f"safetensors.{sub}"


def test_unknown_attribute_is_an_attribute_error(restores_modules):
    with compat.installed(warn=False):
        import safetensors

        assert not hasattr(safetensors, "no_such_name")
        assert not hasattr(safetensors, "torch")  # as the reference: only once imported


def test_except_safetensors_error_catches_engine_errors(restores_modules, tmp_path):
    bad = write_raw(tmp_path / "bad.safetensors", b'{"w": {"dtype": "F32"', 0)
    good = tmp_path / "good.safetensors"
    engine.numpy.save_file({"w": np.ones(3, np.float32)}, good)
    with compat.installed(warn=False):
        import safetensors
        import safetensors.numpy

        caught = []
        for action in (
            lambda: safetensors.safe_open(bad, framework="np"),
            lambda: safetensors.numpy.load_file(bad),
            lambda: safetensors.safe_open(good, framework="np").get_tensor("missing"),
            lambda: safetensors.safe_open(good, framework="no-such-framework"),
        ):
            try:
                action()
            except safetensors.SafetensorError as error:
                caught.append(error)
        assert len(caught) == 4
        assert all(isinstance(error, engine.SafetensorError) for error in caught)


def test_round_trip_through_the_shim_reads_back_with_the_reference(restores_modules, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (the 'torch' extra)")
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(5, dtype=torch.bfloat16),
    }
    path = tmp_path / "m.safetensors"
    with compat.installed(warn=False):
        import safetensors
        import safetensors.torch

        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        with safetensors.safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            loaded = {k: f.get_tensor(k) for k in f.keys()}
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    reference = sys.modules["safetensors.torch"]  # the reference again
    assert reference.__name__ == "safetensors.torch"
    back = reference.load_file(path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


# -- what install() cannot reach --------------------------------------------------------------


def test_install_reports_modules_bound_to_the_reference(restores_modules):
    reference = restores_modules["safetensors"]
    client = types.ModuleType("compat_test_client")
    client.safe_open = reference.safe_open  # as `from safetensors import safe_open` before install
    client.st = reference  # as `import safetensors` before install
    client.unrelated = len
    sys.modules[client.__name__] = client
    try:
        with pytest.warns(RuntimeWarning, match="bound to the reference safetensors before install"):
            compat.install()
        try:
            stale = compat.bound_to_reference()
            assert "compat_test_client.safe_open" in stale
            assert "compat_test_client.st" in stale
            assert "compat_test_client.unrelated" not in stale
        finally:
            compat.uninstall()
        assert compat.bound_to_reference() == []
    finally:
        del sys.modules[client.__name__]


# -- real clients -----------------------------------------------------------------------------

_LLAMA = """
import hashlib, json, os, sys
mode, out = sys.argv[1], sys.argv[2]
if mode == "shim":
    import engine.compat
    engine.compat.install()
import torch
import transformers
import transformers.modeling_utils as mu
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)
model = LlamaForCausalLM(config).eval()
initial = {k: v.clone() for k, v in model.state_dict().items()}
ckpt = os.path.join(out, "ckpt")
model.save_pretrained(ckpt, max_shard_size="40KB")
loaded = LlamaForCausalLM.from_pretrained(ckpt).eval()
ids = torch.arange(32).reshape(2, 16) % config.vocab_size
with torch.no_grad():
    logits = loaded(ids).logits
torch.save(logits, os.path.join(out, "logits.pt"))
shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
print(json.dumps({
    "safe_open": f"{mu.safe_open.__module__}.{mu.safe_open.__qualname__}",
    "safe_save_file": mu.safe_save_file.__module__,
    "reference_extension_loaded": "safetensors._safetensors_rust" in sys.modules,
    "shards": {f: hashlib.sha256(open(os.path.join(ckpt, f), "rb").read()).hexdigest() for f in shards},
    "weights_round_trip": sorted(initial) == sorted(loaded.state_dict())
        and all(torch.equal(initial[k], v) for k, v in loaded.state_dict().items()),
}))
"""


def test_transformers_sharded_round_trip_matches_the_reference(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (the 'test' extra pins it)")
    import torch

    runs = {}
    for mode in ("reference", "shim"):
        (tmp_path / mode).mkdir()
        out = _run(_LLAMA, mode, str(tmp_path / mode))
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    # the shim run really went through the engine, the other through the reference
    assert runs["shim"]["safe_open"].startswith("engine.")
    assert runs["shim"]["safe_save_file"] == "engine.torch"
    assert runs["reference"]["safe_open"].startswith("builtins.")
    assert not runs["shim"]["reference_extension_loaded"] and runs["reference"]["reference_extension_loaded"]
    assert len(runs["shim"]["shards"]) > 1  # sharded
    assert runs["shim"]["weights_round_trip"] and runs["reference"]["weights_round_trip"]
    # same model, same files (metadata has one key, so even the bytes agree), same logits
    assert runs["shim"]["shards"] == runs["reference"]["shards"]
    logits = {mode: torch.load(tmp_path / mode / "logits.pt") for mode in runs}
    assert torch.equal(logits["shim"], logits["reference"])


_ACCELERATE = """
import json, os, sys
out = sys.argv[1]
import engine.compat
engine.compat.install()
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)
LlamaForCausalLM(config).save_pretrained(os.path.join(out, "ckpt"))
model = LlamaForCausalLM.from_pretrained(os.path.join(out, "ckpt")).eval()  # tensors from the engine
expected = {k: v.clone() for k, v in model.state_dict().items()}
Accelerator(cpu=True).save_model(model, os.path.join(out, "saved"), safe_serialization=True)
saved = {}
for f in sorted(os.listdir(os.path.join(out, "saved"))):
    if f.endswith(".safetensors"):
        saved.update(load_file(os.path.join(out, "saved", f)))
print(json.dumps({
    "expected": sorted(expected),
    "saved": sorted(saved),
    "equal": sorted(k for k in saved if k in expected and torch.equal(saved[k], expected[k])),
}))
"""


def test_accelerate_save_model_keeps_every_tensor_of_an_engine_loaded_model(tmp_path):
    # Accelerator.save_model keeps one tensor per storage: tensors that shared one storage
    # per file were dropped (weights lost, with only a warning)
    pytest.importorskip("transformers", reason="transformers is not installed (the 'test' extra pins it)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (the 'test' extra pins it)")
    out = _run(_ACCELERATE, str(tmp_path))
    facts = json.loads(out.strip().splitlines()[-1])
    assert len(facts["expected"]) == 21  # embed, 2 x 9 per layer, norm, lm_head
    assert facts["saved"] == facts["expected"]
    assert facts["equal"] == facts["expected"]


# -- the reference's names and signatures, under the shim ------------------------------------


def _public(module) -> set[str]:
    """The names a user of ``module`` calls: not private, not modules, not the typing aliases
    and stray imports (``Dict``, ``defaultdict``) the reference's modules happen to hold."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", None) not in ("typing", "collections")
    }


@pytest.mark.parametrize("sub", ["", ".torch", ".numpy"])
def test_every_public_name_of_the_reference_is_served(restores_modules, sub):
    """safetensors.torch.serialize, serialize_file, deserialize and TensorSpec (and the same
    in safetensors.numpy) raised AttributeError under the shim."""
    if sub == ".torch":
        pytest.importorskip("torch")
    reference = _public(sys.modules["safetensors" + sub])
    assert {"TensorSpec", "deserialize", "serialize", "serialize_file"} <= reference
    with compat.installed(warn=False):
        shim = importlib.import_module("safetensors" + sub)
        missing = sorted(name for name in reference if not hasattr(shim, name))
        assert missing == []
        assert shim.TensorSpec is engine.TensorSpec and shim.deserialize is engine.deserialize
        assert shim.serialize is engine.serialize and shim.serialize_file is engine.serialize_file


def test_getdtype_as_torch_distributed_checkpoint_imports_it(restores_modules):
    torch = pytest.importorskip("torch")
    reference = sys.modules["safetensors.torch"]._getdtype
    with compat.installed(warn=False):
        from safetensors.torch import _getdtype

    for name in ("F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "U8"):
        assert _getdtype(name) is reference(name)
    assert _getdtype("BF16") is torch.bfloat16
    with pytest.raises(KeyError):
        _getdtype("NOPE")


@pytest.mark.parametrize("name", ["deserialize", "serialize", "serialize_file", "_safe_open_handle", "TensorSpec"])
def test_parameters_are_named_as_the_references(restores_modules, name):
    """deserialize's argument was ``data`` (the reference's is ``bytes``); _safe_open_handle
    defaulted framework to "numpy" (the reference requires it)."""
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]

    ours, theirs = params(getattr(engine, name)), params(getattr(sys.modules["safetensors"], name))
    assert ours[: len(theirs)] == theirs  # the engine may add keyword-only options after them


def test_deserialize_by_keyword(tmp_path):
    data = engine.numpy.save({"a": np.arange(3, dtype=np.int32)})
    import safetensors

    assert engine.deserialize(bytes=data) == safetensors.deserialize(bytes=data)


def test_safe_open_handle_needs_a_framework(tmp_path):
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"a": np.zeros(2, np.float32)}, path)
    with open(path, "rb") as f, pytest.raises(TypeError):
        engine._safe_open_handle(f)


@pytest.mark.parametrize("framework", ["tf", "tensorflow", "flax", "jax", "mlx"])
def test_frameworks_the_engine_does_not_serve_fail_at_the_first_tensor(tmp_path, framework):
    """The reference opens a file with framework="tf" (names, metadata) and fails only where
    it needs TensorFlow; the engine refused at open."""
    import safetensors

    module = {"tf": "tensorflow", "tensorflow": "tensorflow", "flax": "jax", "jax": "jax", "mlx": "mlx"}[framework]
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"a": np.zeros((2, 3), np.float32)}, path, metadata={"k": "v"})
    with engine.safe_open(path, framework=framework) as f:
        assert f.keys() == ["a"] and f.metadata() == {"k": "v"}
        with pytest.raises(ModuleNotFoundError) as ours:
            f.get_tensor("a")
        assert isinstance(ours.value, engine.SafetensorError) and ours.value.name == module
        assert framework in str(ours.value) and "framework='np'" in str(ours.value)
    if importlib.util.find_spec(module) is None:  # as the reference, where the framework is missing
        with safetensors.safe_open(str(path), framework=framework) as g:
            assert g.keys() == ["a"]
            with pytest.raises(ModuleNotFoundError):
                g.get_tensor("a")


def test_paddle_fails_at_open_and_unknown_frameworks_too(tmp_path):
    import safetensors

    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"a": np.zeros(2, np.float32)}, path)
    if importlib.util.find_spec("paddle") is None:
        for opener in (engine.safe_open, safetensors.safe_open):
            with pytest.raises(ModuleNotFoundError):
                opener(str(path), framework="paddle")
    for name in ("paddlepaddle", "PT", ""):
        with pytest.raises(safetensors.SafetensorError):
            safetensors.safe_open(str(path), framework=name)
        with pytest.raises(engine.SafetensorError, match="unsupported framework"):
            engine.safe_open(path, framework=name)
