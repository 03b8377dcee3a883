"""The vLLM load format (engine.serving): the weights it hands to a model, its options and
its check of a load, always; and end to end through vLLM itself where vLLM is installed
(CI runs that part in a venv of its own with vLLM's CPU build: ``.ci/vllm_lane.sh``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="the torch extra")
from safetensors import safe_open as ref_open  # noqa: E402
from safetensors.torch import save_file as ref_save  # noqa: E402

import engine  # noqa: E402
from engine.errors import CheckpointIndexError, MissingShardError, OptionError, TensorNotFoundError  # noqa: E402
from engine.serving import LOAD_FORMAT  # noqa: E402
from engine.serving.weights import (  # noqa: E402
    OPTION_DOCS,
    Options,
    Weights,
    check_loaded,
    checkpoint_files,
    missing_parameters,
    parse_options,
    stage_select,
)

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_python  # noqa: E402
from rangeserver import serve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX = "model.safetensors.index.json"


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "embed.weight": torch.randn(64, 48, generator=g),
        "layer.0.q.weight": torch.randn(48, 48, generator=g).to(torch.bfloat16),
        "layer.0.norm": torch.randn(48, generator=g).to(torch.float16),
        "layer.0.scale": torch.tensor(3.5, dtype=torch.float64),  # 0-dim
        "layer.0.empty": torch.empty(0, 5),
        "layer.1.ids": torch.randint(-100, 100, (7, 3), generator=g, dtype=torch.int64),
        "layer.1.mask": torch.randint(0, 2, (9,), generator=g).bool(),
        "layer.1.q8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "head.weight": torch.randn(48, 64, generator=g),
    }
    for i in range(12):  # enough tensors that shards hold several each
        out[f"block.{i}.w"] = torch.randn(16 + i, 8, generator=g)
    return out


def write_sharded(directory, sd: dict[str, torch.Tensor], shards: int = 3, index: bool = True) -> list[str]:
    """Shards written by the reference ``safetensors``, with a Hugging Face index."""
    os.makedirs(directory, exist_ok=True)
    names = list(sd)
    files, weight_map = [], {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        ref_save({k: sd[k] for k in part}, os.path.join(directory, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update(dict.fromkeys(part, fname))
    if index:
        total = sum(t.numel() * t.element_size() for t in sd.values())
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return files


def reference(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with ref_open(os.path.join(directory, name), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g, w), k


def collect(weights: Weights) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in weights:
        assert name not in out, f"{name} handed out twice"
        out[name] = t.clone()
    return out


# ---------------------------------------------------------------------------- the weights


@pytest.mark.parametrize("cpu", ["view", "owned"])
@pytest.mark.parametrize("shards", [1, 3, 5])
def test_the_weights_of_a_sharded_checkpoint_equal_the_reference(tmp_path, cpu, shards):
    write_sharded(tmp_path, tensors(shards), shards=shards)
    want = reference(tmp_path)
    for source in (tmp_path, tmp_path / INDEX):
        with Weights(source, options=Options(cpu=cpu)) as w:
            got = collect(w)
        assert_same(got, want)
        assert w.tensors == len(want) and w.files == shards
        assert w.nbytes == sum(t.numel() * t.element_size() for t in want.values())
        assert w.mode == cpu and "tensors" in w.summary()


def test_a_directory_without_an_index_loads_every_file_and_a_file_loads_alone(tmp_path):
    files = write_sharded(tmp_path, tensors(1), shards=2, index=False)
    assert_same(collect(Weights(tmp_path)), reference(tmp_path))
    one = {k: v for k, v in reference(tmp_path).items()}
    with ref_open(str(tmp_path / files[0]), framework="pt") as f:
        first = {k: f.get_tensor(k) for k in f.keys()}
    assert_same(collect(Weights(tmp_path / files[0])), first)
    assert len(first) < len(one)


def test_the_shards_of_an_index_are_checked_against_it(tmp_path):
    write_sharded(tmp_path, tensors(), shards=3)
    assert checkpoint_files(tmp_path) == [str(tmp_path / f"model-0000{i}-of-00003.safetensors") for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointIndexError) as err:
        collect(Weights(tmp_path))
    assert "ghost.weight" in str(err.value)
    index["weight_map"].pop("ghost.weight")
    (tmp_path / INDEX).write_text(json.dumps(index))
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(MissingShardError, match="model-00002-of-00003"):
        collect(Weights(tmp_path))


def test_a_directory_without_weights_and_a_missing_path_are_errors(tmp_path):
    with pytest.raises(engine.SafetensorError, match="no safetensors file"):
        collect(Weights(tmp_path))
    with pytest.raises(FileNotFoundError):
        collect(Weights(tmp_path / "nothing"))


def test_a_url_loads_through_the_remote_path_and_its_cache(tmp_path):
    write_sharded(tmp_path / "model", tensors(2), shards=2)
    want = reference(tmp_path / "model")
    server = serve(str(tmp_path))
    server.etags = True  # versions a cache can tell apart
    try:
        url = server.url(f"model/{INDEX}")
        cache = tmp_path / "cache"
        for _ in range(2):  # the first load writes the copies, the second reads them
            with Weights(url, options=parse_options({"cache_dir": str(cache), "connections": 2})) as w:
                assert_same(collect(w), want)
            assert w.mode == "remote"
        copies = sorted(p.name for p in cache.rglob("*.safetensors"))
        assert len(copies) == 2 and all(c.endswith(f"-model-0000{i}-of-00002.safetensors")
                                        for i, c in zip((1, 2), sorted(copies, key=lambda c: c[-32:]), strict=True))
    finally:
        server.stop()


GROUP_WEIGHTS = textwrap.dedent("""
    import hashlib, json, os, sys
    import torch, torch.distributed as dist
    from engine.serving.weights import Weights, parse_options
    rank, port, url, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    extra = json.loads(sys.argv[5].replace("{rank}", str(rank)))  # a cache directory per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    with Weights(url, options=parse_options(extra), group=dist.group.WORLD) as w:
        got = {k: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for k, t in w}
    json.dump({"mode": w.mode, "tensors": got}, open(out, "w"))
    dist.barrier()
    os._exit(0)
""")


@pytest.mark.parametrize(("extra", "mode", "reads"), [
    ({}, "group", 1), ({"distributed": False}, "remote", 2), ({"cache_dir": "{tmp}/c{rank}"}, "remote", 2),
    ({"distributed": True, "cache_dir": "{tmp}/c{rank}"}, "group", 1)])
def test_the_workers_of_a_group_read_url_weights_once_between_them(tmp_path, extra, mode, reads):
    """Two gloo ranks, each with its own Weights over the same URL: by default they read the
    checkpoint once between them; ``distributed: false`` reads it on each, and so does a
    ``cache_dir`` unless ``distributed`` is asked for (then each keeps a whole copy)."""
    import hashlib

    from rangeserver import serving
    from servers import free_port

    sd = tensors(3)
    write_sharded(tmp_path / "model", sd, shards=2)
    want = {k: hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in sd.items()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    with serving(str(tmp_path)) as server:
        server.bulk()
        url = server.url(f"model/{INDEX}")
        procs = [subprocess.Popen([sys.executable, "-c", GROUP_WEIGHTS, str(r), str(port), url,
                                   str(tmp_path / f"{r}.json"), json.dumps(extra).replace("{tmp}", str(tmp_path))],
                                  env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        asked = server.tensor_bytes_asked()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    for r in range(2):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got == {"mode": mode, "tensors": want}
        if "cache_dir" in extra:
            assert len(list((tmp_path / f"c{r}").glob("*.safetensors"))) == 2
    assert reads * nbytes <= asked <= reads * nbytes * 1.02 + 128, (asked, nbytes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no CUDA device")
def test_a_cuda_load_goes_to_the_ring_with_its_options_and_fails_clearly_without_a_gpu(tmp_path):
    write_sharded(tmp_path, tensors(), shards=2)
    w = Weights(tmp_path, device="cuda:0", options=parse_options({"slot_bytes": "4MiB", "per_tensor": True,
                                                                  "threads": 2, "chunk_bytes": 1 << 20}))
    assert w.mode == "ring"
    with pytest.raises(engine.DeviceError, match="CUDA"):
        collect(w)  # the stream's options were accepted: the device is what fails


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA build of torch")
@pytest.mark.parametrize("per_tensor", [True, False])
def test_a_cuda_load_through_the_ring_equals_the_reference(tmp_path, per_tensor):
    write_sharded(tmp_path, tensors(4), shards=3)
    with Weights(tmp_path, device="cuda:0", options=Options(per_tensor=per_tensor)) as w:
        got = {}
        for name, t in w:
            assert t.device.type == "cuda", name
            got[name] = t.cpu()
    assert_same(got, reference(tmp_path))


# ----------------------------------------------------------------------- the rule for views


def _rewrite_data(path, shard_tensors):
    """Overwrite the file's tensor bytes in place (no truncation)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)
        f.write(b"\x7f" * (size - 8 - n))


def test_a_view_that_the_model_keeps_never_sees_the_file_change(tmp_path):
    sd = {"big": torch.arange(300_000, dtype=torch.float32), "small": torch.ones(10)}
    ref_save(sd, str(tmp_path / "model.safetensors"))
    with Weights(tmp_path) as w:
        kept = {name: t for name, t in w}  # a weight loader that keeps what it is handed
    assert w.kept == [str(tmp_path / "model.safetensors")]
    # the control: a view of a private mapping follows the file until written
    with engine.safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        control = f.get_tensor("big")
        _rewrite_data(tmp_path / "model.safetensors", sd)
        assert not torch.equal(control, sd["big"])
    assert torch.equal(kept["big"], sd["big"]) and torch.equal(kept["small"], sd["small"])


def test_a_kept_view_survives_the_file_truncated(tmp_path):
    """In a child: a mapping read past the file's end would kill the process with SIGBUS."""
    out = run_python(textwrap.dedent("""
        import os, sys, torch
        from safetensors.torch import save_file
        from engine.serving.weights import Weights
        path = os.path.join(sys.argv[1], "model.safetensors")
        save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
        with Weights(sys.argv[1]) as w:
            kept = dict(w)
        os.truncate(path, 100)
        print(float(kept["w"].sum()), float(torch.arange(1 << 20, dtype=torch.float32).sum()), w.kept == [path])
    """), str(tmp_path))
    got, want, listed = out.split()
    assert got == want and listed == "True"


def test_views_that_the_model_copies_are_not_made_private(tmp_path):
    write_sharded(tmp_path, tensors(), shards=2)
    params = {k: torch.empty_like(v) for k, v in reference(tmp_path).items()}

    def load_weights(weights) -> None:  # as a server's: copies, and keeps nothing once it returns
        for name, t in weights:
            params[name].copy_(t)

    with Weights(tmp_path) as w:
        load_weights(w)
    assert w.kept == []
    assert_same(params, reference(tmp_path))


# ------------------------------------------------------------------------------ options


def test_options_are_parsed_and_checked():
    o = parse_options({"threads": 4, "chunk_bytes": "8MiB", "slot_bytes": 1 << 22, "cpu": "owned",
                       "per_tensor": False, "stats": True, "timeout": 5, "headers": {"A": "b"},
                       "s3": {"region": "eu-west-1"}, "weights": "s3://b/m/", "max_header_size": 1000,
                       "cache_dir": "/tmp/x", "connections": 3})
    assert (o.threads, o.chunk_bytes, o.slot_bytes, o.cpu, o.per_tensor, o.stats) == (4, 8 << 20, 1 << 22, "owned",
                                                                                     False, True)
    assert o.timeout == 5.0 and o.remote()["connections"] == 3 and o.remote()["max_header_size"] == 1000
    assert parse_options(None) == Options() == parse_options({}) == parse_options({"threads": None})
    assert set(OPTION_DOCS) == {f.name for f in Options.__dataclass_fields__.values()}


@pytest.mark.parametrize(("extra", "option"), [
    ({"thread": 4}, "thread"),
    ({"threads": 0}, "threads"),
    ({"threads": "4"}, "threads"),
    ({"threads": True}, "threads"),
    ({"chunk_bytes": "lots"}, "chunk_bytes"),
    ({"chunk_bytes": -1}, "chunk_bytes"),
    ({"slot_bytes": 1.5}, "slot_bytes"),
    ({"cpu": "mmap"}, "cpu"),
    ({"per_tensor": 1}, "per_tensor"),
    ({"stats": "yes"}, "stats"),
    ({"timeout": 0}, "timeout"),
    ({"headers": {"A": 1}}, "headers"),
    ({"headers": ["A"]}, "headers"),
    ({"s3": {"bucket": "x"}}, "s3"),
    ({"weights": ""}, "weights"),
    ({"cache_dir": 3}, "cache_dir"),
    ({"max_header_size": -5}, "max_header_size"),
])
def test_a_bad_option_is_an_error_naming_it(extra, option):
    with pytest.raises(OptionError) as err:
        parse_options(extra)
    assert isinstance(err.value, ValueError)
    assert err.value.option == option and repr(option) in str(err.value)


def test_an_unknown_option_suggests_the_known_one_and_a_non_object_is_refused():
    with pytest.raises(OptionError, match="did you mean 'threads'"):
        parse_options({"thread": 2})
    with pytest.raises(OptionError, match="JSON object"):
        parse_options(["threads"])  # type: ignore[arg-type]


def test_options_for_url_weights_are_refused_with_a_local_checkpoint(tmp_path):
    write_sharded(tmp_path, tensors(), shards=1)
    with pytest.raises(OptionError) as err:
        Weights(tmp_path, options=parse_options({"cache_dir": str(tmp_path / "c")}))
    assert err.value.option == "cache_dir" and str(tmp_path) in str(err.value)


# ------------------------------------------------------------------ the check of a load


def test_missing_weights_are_an_error_naming_them():
    params = ["a.weight", "b.weight", "c.bias", "d.scale"]
    assert missing_parameters(params, ["a.weight", "c.bias"], exempt=["d.scale"]) == ["b.weight"]
    check_loaded(params, params)
    with pytest.raises(TensorNotFoundError) as err:
        check_loaded(params, ["a.weight"], exempt=["d.scale"], source="/models/x")
    assert err.value.tensors == ("b.weight", "c.bias") and err.value.reason == "MissingWeights"
    assert "b.weight" in str(err.value) and "c.bias" in str(err.value) and "/models/x" in str(err.value)
    many = [f"p{i}" for i in range(30)]
    with pytest.raises(TensorNotFoundError, match="and 10 more"):
        check_loaded(many, [])


# -------------------------------------------------------------------------- packaging


def test_the_plugin_is_an_entry_point_and_importing_it_imports_no_server():
    import tomllib

    project = tomllib.loads(open(os.path.join(ROOT, "pyproject.toml"), "rb").read().decode())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {LOAD_FORMAT: "engine.serving.vllm:register"}
    assert any(r.startswith("vllm") for r in project["optional-dependencies"]["vllm"])
    assert not any(r.startswith("vllm") for r in project["optional-dependencies"]["test"])
    out = run_python(textwrap.dedent("""
        import sys
        import engine.serving, engine.serving.vllm, engine.serving.weights
        print(engine.serving.vllm.LOAD_FORMAT == engine.serving.LOAD_FORMAT,
              sorted(m for m in ("vllm", "torch", "numpy", "sglang") if m in sys.modules))
    """))
    assert out.split(None, 1) == ["True", "[]\n"]


# ------------------------------------------------------------ end to end, through vLLM

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# the vLLM lane sets it: there a missing vLLM fails these tests instead of skipping them
REQUIRE_VLLM = os.environ.get("ENGINE_TESTS_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not HAS_VLLM and not REQUIRE_VLLM,
                                reason="vLLM is not installed (the vllm extra; CI runs this in .ci/vllm_lane.sh's "
                                       "venv with vLLM's CPU build)")

LLAMA = {"hidden": 128, "heads": 2, "layers": 2, "inter": 256, "vocab": 512}


def write_llama(directory, drop: tuple[str, ...] = ()) -> None:
    """A tiny Llama (head size 64, float32) in 4 shards with an index, and its config."""
    h, inter, vocab = LLAMA["hidden"], LLAMA["inter"], LLAMA["vocab"]
    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.4

    sd = {"model.embed_tokens.weight": w(vocab, h)}
    for i in range(LLAMA["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + w(h) * 0.1
        for n in "qkvo":
            sd[p + f"self_attn.{n}_proj.weight"] = w(h, h) / 4
        sd[p + "post_attention_layernorm.weight"] = 1 + w(h) * 0.1
        sd[p + "mlp.gate_proj.weight"] = w(inter, h) / 4
        sd[p + "mlp.up_proj.weight"] = w(inter, h) / 4
        sd[p + "mlp.down_proj.weight"] = w(h, inter) / 4
    sd["model.norm.weight"] = 1 + w(h) * 0.1
    sd["lm_head.weight"] = w(vocab, h)
    for name in drop:
        sd.pop(name)
    write_sharded(directory, sd, shards=4)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": LLAMA["heads"], "num_key_value_heads": LLAMA["heads"], "head_dim": 64,
        "num_hidden_layers": LLAMA["layers"], "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


# one vLLM engine per process: greedy tokens of three prompts, and every parameter of the
# model as vLLM holds it after loading (safetensors file written by the reference)
RUN_LLM = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    model, fmt, out, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    llm = LLM(model=model, load_format=fmt, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.08, model_loader_extra_config=extra,
              tensor_parallel_size=int(os.environ.get("LANE_TP", "1")))
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 42, 99], [300, 2, 7], [11] * 9)]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens = [list(r.outputs[0].token_ids) for r in results]

    def params(model):
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}

    if os.environ.get("LANE_TP", "1") == "1":  # (workers in processes of their own cannot unpickle params)
        state = llm.apply_model(params)[0]
        from safetensors.torch import save_file
        save_file(state, out + ".safetensors")
    json.dump(tokens, open(out + ".json", "w"))
""")


def run_llm(model, fmt: str, out, extra: dict | None = None, tp: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", LANE_TP=str(tp))
    if tp > 1:  # vLLM's CPU build binds each worker's OpenMP threads to cores of its own
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return subprocess.run([sys.executable, "-c", RUN_LLM, str(model), fmt, str(out), json.dumps(extra or {})],
                          capture_output=True, text=True, env=env, timeout=600)


@needs_vllm
def test_vllm_generates_the_same_tokens_with_the_same_parameters_as_its_own_loader(tmp_path):
    write_llama(tmp_path / "llama")
    runs = {}
    for fmt, extra in (("safetensors", None), (LOAD_FORMAT, {"stats": True})):
        proc = run_llm(tmp_path / "llama", fmt, tmp_path / fmt, extra)
        assert proc.returncode == 0, f"{fmt}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        with ref_open(str(tmp_path / f"{fmt}.safetensors"), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        runs[fmt] = (json.loads((tmp_path / f"{fmt}.json").read_text()), state, proc.stdout + proc.stderr)
    (want_tokens, want_state, _), (tokens, state, log) = runs["safetensors"], runs[LOAD_FORMAT]
    assert "Loading weights took" in log and "safetensors-engine (view, cpu)" in log
    assert tokens == want_tokens and all(len(t) == 12 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the prompts lead somewhere different
    assert_same(state, want_state)
    assert len(state) >= 9


@needs_vllm
def test_vllm_tensor_parallel_workers_read_url_weights_once_between_them(tmp_path):
    """tensor_parallel_size=2, weights from a URL: the two workers read the checkpoint once
    between them (the ``distributed`` default), and generate the tokens vLLM's own loader
    generates from the local files at the same TP."""
    from rangeserver import serving

    write_llama(tmp_path / "llama")
    tensor_bytes = sum(os.path.getsize(p) for p in (tmp_path / "llama").glob("*.safetensors"))
    proc = run_llm(tmp_path / "llama", "safetensors", tmp_path / "own", tp=2)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with serving(str(tmp_path)) as server:
        server.bulk()
        proc = run_llm(tmp_path / "llama", LOAD_FORMAT, tmp_path / "ours", {"weights": server.url(f"llama/{INDEX}"),
                                                                          "stats": True}, tp=2)
        asked = server.tensor_bytes_asked()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "safetensors-engine (group, cpu)" in log, log[-3000:]
    assert json.loads((tmp_path / "ours.json").read_text()) == json.loads((tmp_path / "own.json").read_text())
    assert 0.9 * tensor_bytes <= asked <= 1.1 * tensor_bytes, (asked, tensor_bytes)


@needs_vllm
def test_vllm_with_missing_weights_fails_naming_them(tmp_path):
    write_llama(tmp_path / "llama", drop=("model.norm.weight", "model.layers.1.input_layernorm.weight"))
    proc = run_llm(tmp_path / "llama", LOAD_FORMAT, tmp_path / "out")
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "TensorNotFoundError" in log and "model.norm.weight" in log and "model.layers.1.input_layernorm.weight" in log


@needs_vllm
def test_the_entry_point_registers_the_format_once_and_checks_options():
    out = run_python(textwrap.dedent("""
        import logging, warnings
        from vllm.plugins import load_general_plugins
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        load_general_plugins()
        import engine.serving.vllm as plugin
        loader = get_model_loader(LoadConfig(load_format="safetensors_engine",
                                             model_loader_extra_config={"threads": 2, "cpu": "owned"}))
        first = type(loader)
        records = []
        logging.getLogger("vllm").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r)})())
        plugin.register(); plugin.register()
        again = type(get_model_loader(LoadConfig(load_format="safetensors_engine")))
        overwritten = [r for r in records if "already registered" in r.getMessage()]
        try:
            get_model_loader(LoadConfig(load_format="safetensors_engine", model_loader_extra_config={"treads": 2}))
            bad = None
        except ValueError as err:
            bad = f"{type(err).__name__}|{err}"
        print(first is again is plugin.loader_class(), loader.options.threads, loader.options.cpu, len(overwritten))
        print(bad)
    """), timeout=300)
    first, bad = out.strip().splitlines()[-2:]
    assert first == "True 2 owned 0"
    assert bad.startswith("OptionError|") and "'treads'" in bad and "did you mean 'threads'" in bad


def test_a_pipeline_stage_reads_its_own_layers_and_what_every_stage_shares():
    """Stage 2 of 2 of a four-layer model holds layers 2 and 3 (vLLM gives the others no
    parameters) and all of its vision tower's."""
    held = ["model.layers.2.self_attn.qkv_proj.weight", "model.layers.3.mlp.gate_up_proj.weight",
            "model.norm.weight", "lm_head.weight", "vision.encoder.layers.0.w", "vision.encoder.layers.1.w"]
    select = stage_select(held)
    assert select("model.layers.2.self_attn.q_proj.weight") and select("model.layers.3.mlp.up_proj.weight")
    assert not select("model.layers.0.self_attn.q_proj.weight") and not select("model.layers.1.mlp.up_proj.weight")
    assert select("model.embed_tokens.weight") and select("model.norm.weight") and select("lm_head.weight")
    assert select("vision.encoder.layers.0.w") and select("vision.encoder.layers.1.w")
    # a checkpoint whose prefix the model maps (one match by suffix), and one the model does not name
    assert not select("language_model.model.layers.0.w") and select("language_model.model.layers.3.w")
    assert select("mtp.layers.0.w")


@pytest.mark.parametrize("how", ["view", "owned", "url"])
def test_weights_read_only_the_tensors_select_takes(tmp_path, how):
    write_sharded(tmp_path / "model", tensors(4), shards=3)
    want = {k: v for k, v in reference(tmp_path / "model").items() if k.startswith("block.")}
    server = serve(str(tmp_path)) if how == "url" else None
    try:
        source = server.url(f"model/{INDEX}") if server is not None else tmp_path / "model"
        options = Options(cpu=how) if server is None else None
        with Weights(source, options=options, select=lambda name: name.startswith("block.")) as w:
            got = collect(w)
    finally:
        if server is not None:
            server.stop()
    assert_same(got, want)
    assert w.nbytes == sum(t.numel() * t.element_size() for t in want.values())


def test_vllm_pipeline_stages_read_their_own_layers(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is an optional extra (CI's vLLM lane installs it)")
    import types

    from vllm.distributed import parallel_state
    from vllm.model_executor.models.utils import PPMissingLayer

    from engine.serving.vllm import pipeline_stage

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([PPMissingLayer(), PPMissingLayer(), torch.nn.Linear(2, 2),
                                              torch.nn.Linear(2, 2)])
    model.model.norm = torch.nn.LayerNorm(2)
    monkeypatch.setattr(parallel_state, "_PP", None, raising=False)
    assert pipeline_stage(model) is None
    monkeypatch.setattr(parallel_state, "_PP", types.SimpleNamespace(world_size=2), raising=False)
    select = pipeline_stage(model)
    assert select("model.layers.3.weight") and select("model.norm.weight") and select("model.embed_tokens.weight")
    assert not select("model.layers.0.weight") and not select("model.layers.1.bias")


def test_a_server_with_no_tensor_parallel_group_is_warned_of(caplog):
    """A server whose distributed state is set up but names no TP group: the workers would each
    read the whole checkpoint, and the log says so (silently before)."""
    import types

    from engine.serving.weights import tp_group_of

    with caplog.at_level("WARNING", logger="engine.serving"):
        assert tp_group_of(types.SimpleNamespace(__name__="parallel_state", _WORLD=object())) is None
    assert "no tensor-parallel group" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.serving"):
        assert tp_group_of(types.SimpleNamespace(_WORLD=None)) is None  # one process: nothing to say
        group = types.SimpleNamespace(world_size=2, cpu_group="gloo side")
        assert tp_group_of(types.SimpleNamespace(_TP=group, _WORLD=object())) == "gloo side"
    assert caplog.text == ""
