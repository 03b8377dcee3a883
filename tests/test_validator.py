"""The weight validator on small generated LLaMA-shaped checkpoints, clean and with faults."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import engine
import engine.numpy
from engine.apps.validator import ConfigError, WeightValidator, expected_tensors

pytest.importorskip("numba", reason="the statistics kernels need Numba (a test extra)")

CONFIG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)


def checkpoint(config=CONFIG, dtype=ml_dtypes.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1 and "norm" in name:
            out[name] = np.ones(shape, dtype)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
    return out


def test_clean_checkpoint_passes(tmp_path):
    path = tmp_path / "model.safetensors"
    engine.numpy.save_file(checkpoint(), path)
    report = WeightValidator(CONFIG).validate(path)
    assert report.ok, report.problems
    assert report.parameters == report.recognised_parameters == report.expected_parameters > 0
    assert report.dtypes == {"BF16": 3 * 7 + 2}
    assert not report.outliers
    assert "OK" in str(report)
    data = json.loads(report.to_json())
    assert data["ok"] is True and len(data["tensors"]) == len(expected_tensors(CONFIG))


def test_each_injected_fault_is_caught(tmp_path):
    sd = checkpoint()
    for suffix in ("q_proj", "k_proj", "v_proj", "o_proj"):  # a missing layer's attention
        del sd[f"model.layers.1.self_attn.{suffix}.weight"]
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :31].copy()  # wrong shape
    bad = sd["model.layers.2.mlp.down_proj.weight"].astype(np.float32)
    bad[0, 0], bad[1, 1] = np.nan, np.inf
    sd["model.layers.2.mlp.down_proj.weight"] = bad.astype(ml_dtypes.bfloat16)  # NaN and Inf
    sd["model.layers.2.mlp.gate_proj.weight"] = sd["model.layers.2.mlp.gate_proj.weight"].astype(np.float32)  # mixed
    sd["extra.weight"] = np.zeros(3, np.float32)
    path = tmp_path / "model.safetensors"
    engine.numpy.save_file(sd, path)
    report = WeightValidator(CONFIG).validate(path)
    assert not report.ok
    assert sorted(report.missing) == sorted(f"model.layers.1.self_attn.{s}.weight" for s in ("q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"))
    assert report.unexpected == ["extra.weight"]
    assert report.mismatched == [dict(name="model.layers.0.mlp.up_proj.weight", expected=[64, 32], actual=[64, 31])]
    assert report.mixed_dtypes == ["model.layers.2.mlp.gate_proj.weight"]
    assert report.nonfinite == [dict(name="model.layers.2.mlp.down_proj.weight", nan=1, posinf=1, neginf=0)]
    assert report.recognised_parameters != report.expected_parameters
    assert report.parameters == sum(a.size for a in sd.values())  # every tensor, "extra.weight" too
    text = str(report)
    assert "PROBLEMS" in text and "NaN" in text and "missing" in text


def test_outliers_are_notes(tmp_path):
    sd = checkpoint(dtype=np.float32)
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"] * 1000
    sd["model.layers.2.mlp.up_proj.weight"][:] = 0
    path = tmp_path / "model.safetensors"
    engine.numpy.save_file(sd, path)
    report = WeightValidator(CONFIG).validate(path)
    names = {o["name"] for o in report.outliers}
    assert "model.layers.1.mlp.up_proj.weight" in names and "model.layers.2.mlp.up_proj.weight" in names
    assert report.ok  # outliers inform, they do not fail a checkpoint


def test_sharded_checkpoint_and_config_file(tmp_path):
    engine.save_sharded(checkpoint(), tmp_path / "ck", max_shard_size=20_000)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(CONFIG))
    report = WeightValidator(tmp_path / "ck" / "config.json").validate(tmp_path / "ck")
    assert report.ok, report.problems


def test_tied_embeddings_bitnet_and_biases():
    tied = expected_tensors(dict(CONFIG, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied
    bitnet = expected_tensors(dict(CONFIG, model_type="bitnet"))
    assert bitnet["model.layers.0.mlp.ffn_sub_norm.weight"] == (64,)
    assert bitnet["model.layers.0.self_attn.attn_sub_norm.weight"] == (32,)
    qwen = expected_tensors(dict(CONFIG, attention_bias=True))
    assert qwen["model.layers.0.self_attn.k_proj.bias"] == (16,)


def test_headers_only_mode_reads_no_tensor_bytes(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    engine.numpy.save_file(checkpoint(), path)
    import engine.numerics.statistics as stats_module

    monkeypatch.setattr(stats_module, "stats", lambda *a, **k: pytest.fail("statistics were computed"))
    report = WeightValidator(CONFIG, statistics=False).validate(path)
    assert report.ok and not report.tensors


@pytest.mark.parametrize("bad", [dict(CONFIG, hidden_size=0), {k: v for k, v in CONFIG.items() if k != "vocab_size"},
                                 dict(CONFIG, num_key_value_heads=3), dict(CONFIG, hidden_size=30)])
def test_bad_configs(bad):
    with pytest.raises(ConfigError):
        WeightValidator(bad)


def test_config_file_errors(tmp_path):
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="object"):
        WeightValidator(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="cannot read"):
        WeightValidator(tmp_path / "missing.json")



def test_a_long_list_of_missing_tensors_says_how_many_more_it_does_not_name():
    from engine.apps.validator import ValidationReport

    report = ValidationReport(path="model", missing=[f"layers.{i}.w" for i in range(9)], unexpected=["a", "b"])
    missing, unexpected = report.problems[:2]
    assert missing == "9 missing tensor(s): layers.0.w, layers.1.w, layers.2.w, layers.3.w, layers.4.w, and 4 more"
    assert unexpected == "2 unexpected tensor(s): a, b"
