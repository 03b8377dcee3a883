"""The command line, through its entry point in a subprocess."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import engine.numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's engine first


def run(*args, check=False):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, check=check)


def test_demo_small(tmp_path):
    out = run("demo", "--small", "--dir", str(tmp_path), check=True)
    assert "demo: all checks passed" in out.stdout
    assert "identical" in out.stdout and "MISMATCH" not in out.stdout
    assert (tmp_path / "gpt2.safetensors").exists()
    assert out.stdout.splitlines()[-1] == f"kept {tmp_path / 'gpt2.safetensors'}"


@pytest.mark.parametrize("keep", [False, True])
def test_the_demos_last_line_names_a_file_that_exists_or_says_it_was_removed(keep):
    """Without --dir the demo removed its temporary directory and the last path it printed was
    gone, with no word of it; now the last line names the kept file or the removed directory."""
    out = run("demo", "--small", *(["--keep"] if keep else []), check=True)
    last = out.stdout.splitlines()[-1]
    if keep:
        kept = last.removeprefix("kept ")
        assert kept != last and os.path.isfile(kept), last
        import shutil

        shutil.rmtree(os.path.dirname(kept))
    else:
        removed = last.removeprefix("removed ").split(";")[0]
        assert removed != last and not os.path.exists(removed) and "--keep" in last, last
        assert removed in out.stdout.split("save_file", 1)[1], out.stdout  # the directory the file was in


def test_the_readme_says_how_to_keep_the_demos_checkpoint():
    """The README named neither --keep nor --dir, so a new user had no file to try its examples on."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "--keep" in text and "--dir" in text and "--small" in text


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(
        {"a.weight": np.zeros((3, 4), np.float32), "b": np.ones(5, np.int64)}, path, metadata={"format": "np"}
    )
    return path


def test_inspect_table(model):
    out = run("inspect", str(model), check=True)
    assert "a.weight" in out.stdout and "F32" in out.stdout and "[3, 4]" in out.stdout
    assert "17 parameters" in out.stdout


def test_inspect_json_round_trips(model):
    out = run("inspect", str(model), "--json", check=True)
    data = json.loads(out.stdout)
    assert data["a.weight"]["shape"] == [3, 4]
    assert data["__metadata__"] == {"format": "np"}


def test_broken_file_is_one_line_and_nonzero_exit(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    out = run("inspect", str(bad))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "HeaderTooLarge" in out.stderr and str(bad) in out.stderr


def test_missing_file(tmp_path):
    out = run("inspect", str(tmp_path / "nope.safetensors"))
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nope.safetensors" in out.stderr
    # the reason tag every error carries, not the operating system's "[Errno 2]"
    assert out.stderr.rstrip().endswith("No such file or directory [NotFound]") and "Errno" not in out.stderr


@pytest.mark.parametrize("command", ["inspect", "stats", "validate", "quantize", "convert", "bench"])
def test_every_error_line_ends_with_its_reason_tag(tmp_path, capsys, command):
    """A missing input and an input that is a directory: each command's one line ends
    with a [Reason] tag."""
    for src, tag in ((tmp_path / "missing.safetensors", "[NotFound]"), (tmp_path / "folder.bin", None)):
        if tag is None:
            src.mkdir()
        extra = [str(tmp_path / "out.safetensors")] if command in ("quantize", "convert") else []
        code, _, err = in_process(capsys, command, str(src), *extra)
        assert code == 2 and err.count("\n") == 1, err
        assert re.search(r" \[[A-Za-z]+\]$", err.rstrip()), err
        assert "Errno" not in err and (tag is None or err.rstrip().endswith(tag)), err


def test_error_line_tags_operating_system_errors():
    from engine.commands._cli_output import UsageError, error_line
    from engine.errors import SafetensorError

    assert error_line(PermissionError(errno.EACCES, "Permission denied", "/m.safetensors")) == (
        "/m.safetensors: Permission denied [PermissionDenied]")
    assert error_line(OSError(errno.EIO, "Input/output error")) == "Input/output error [EIO]"
    assert error_line(UsageError("--runs must be positive")) == "--runs must be positive [Usage]"
    assert error_line(SafetensorError("bad", reason="Bad", path="/x")) == "/x: bad [Bad]"
    assert error_line(SafetensorError("no reason given")) == "no reason given [SafetensorError]"


def test_convert_checks_its_arguments_before_importing_torch(tmp_path):
    """A missing or wrong input is refused without the seconds torch's import takes."""
    (tmp_path / "text.bin").write_text("not a checkpoint")
    for src in ("missing.bin", "text.bin"):
        code = ("import sys; from engine.commands.cli import main; "
                f"rc = main(['convert', {str(tmp_path / src)!r}, {str(tmp_path / 'out.safetensors')!r}]); "
                "print(rc, 'torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)


# --------------------------------------------------------------------------- checkpoints, URLs

import shutil  # noqa: E402

from engine.checkpoints.checkpoint import save_sharded  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import StdlibHTTP  # noqa: E402


def table(stdout: str) -> str:
    return stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    rng = np.random.default_rng(0)
    sd = {f"layers.{i}.weight": rng.standard_normal((8, 4 + i)).astype(np.float32) for i in range(6)}
    sd["embed"] = np.arange(40, dtype=np.int64).reshape(10, 4)
    (root / "single").mkdir()
    engine.numpy.save_file(sd, root / "single" / "model.safetensors", metadata={"format": "np"})
    save_sharded(sd, root / "sharded", max_shard_size=400, metadata={"format": "np"})
    server = serve(str(root))
    yield root, server, sd
    server.stop()


def test_inspect_same_table_for_file_directory_and_url(checkpoints):
    root, server, _ = checkpoints
    outs = [
        run("inspect", str(root / "single" / "model.safetensors"), check=True).stdout,
        run("inspect", str(root / "single"), check=True).stdout,
        run("inspect", server.url("single/model.safetensors"), "--timeout", "5", check=True).stdout,
    ]
    assert outs[0] == outs[1] == outs[2]
    assert "embed" in outs[0] and "I64" in outs[0] and "[10, 4]" in outs[0] and "0..320" in outs[0]


@pytest.mark.parametrize("where", ["single", "sharded"])
def test_inspect_of_a_folder_url_without_its_slash(checkpoints, capsys, where):
    """http.server redirects /single to /single/: the URL names that folder (it used to
    fail: "the server sent an HTML page ... [NotSafetensors]")."""
    root, _, _ = checkpoints
    with StdlibHTTP(str(root)) as srv:
        code, out, err = in_process(capsys, "inspect", srv.url(where), "--timeout", "5")
    assert code == 0 and err == ""
    assert out == run("inspect", str(root / where), check=True).stdout


def test_inspect_same_table_for_directory_index_and_url(checkpoints):
    root, server, sd = checkpoints
    outs = [
        run("inspect", str(root / "sharded"), check=True).stdout,
        run("inspect", str(root / "sharded" / "model.safetensors.index.json"), check=True).stdout,
        run("inspect", server.url("sharded/model.safetensors.index.json"), "--timeout", "5", check=True).stdout,
    ]
    assert outs[0] == outs[1] == outs[2]
    total = sum(a.size for a in sd.values())
    assert f"{len(sd)} tensors in " in outs[0] and f"{total:,} parameters" in outs[0]
    assert "model-00001-of-" in outs[0] and "\nindex metadata:\n  total_size: " in outs[0]
    # the sharded and the single checkpoint list the same tensors, dtypes, shapes, counts
    single = run("inspect", str(root / "single"), check=True).stdout

    def cells(text):
        return sorted(tuple(line.split()[:4]) for line in text.splitlines()[1:] if line and "[" in line)

    assert cells(single) == cells(outs[0])


def test_inspect_json_sharded(checkpoints):
    root, server, sd = checkpoints
    local = json.loads(run("inspect", str(root / "sharded"), "--json", check=True).stdout)
    remote = json.loads(run("inspect", server.url("sharded/model.safetensors.index.json"), "--json", check=True).stdout)
    assert local == remote
    assert set(local["weight_map"]) == set(sd) and local["metadata"]["total_size"] > 0


def test_inspect_url_errors_are_one_line(checkpoints):
    _, server, _ = checkpoints
    out = run("inspect", server.url("nope.safetensors"), "--timeout", "5")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "404" in out.stderr and "nope.safetensors" in out.stderr


def test_validate_ok_and_problems(checkpoints, tmp_path):
    root, server, _ = checkpoints
    out = run("validate", str(root / "sharded"))
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout.splitlines()[-1] and "ok: index" in out.stdout
    out = run("validate", server.url("sharded/model.safetensors.index.json"), "--timeout", "5")
    assert out.returncode == 0, out.stderr

    broken = tmp_path / "broken"
    shutil.copytree(root / "sharded", broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = sorted(set(index["weight_map"].values()))[0]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = broken / sorted(set(index["weight_map"].values()))[-1]
    shard.write_bytes(shard.read_bytes()[:-4])  # truncated data region
    out = run("validate", str(broken))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    problems = [line for line in out.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 2
    assert any("MetadataIncompleteBuffer" in p for p in problems) and any("ghost" in p for p in problems)

    out = run("validate", str(tmp_path / "missing"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_validate_weight_checks_skipped_or_run(model):
    out = run("validate", str(model))
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr
    try:
        import engine.apps.validator  # noqa: F401
    except ModuleNotFoundError:
        assert "weight checks: skipped" in out.stderr and out.returncode == 0


@pytest.mark.parametrize("command", ["stats", "quantize"])
def test_stats_and_quantize_wiring(model, tmp_path, command):
    args = [str(model)] if command == "stats" else [str(model), str(tmp_path / "q.safetensors")]
    out = run(command, *args)
    assert "Traceback" not in out.stderr
    assert out.returncode == 0, out.stderr
    if command == "quantize":
        assert (tmp_path / "q.safetensors").exists()


def test_quantize_options(tmp_path):
    pytest.importorskip("numba", reason="quantization needs Numba (a test extra)")
    rng = np.random.default_rng(0)
    src = tmp_path / "m.safetensors"
    tensors = {
        "layer.q.weight": rng.standard_normal((4, 6)).astype(np.float32),
        "layer.k.weight": rng.standard_normal((4, 6)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((4, 6)).astype(np.float32),
    }
    engine.numpy.save_file(tensors, src)
    dst = tmp_path / "q.safetensors"
    out = run("quantize", str(src), str(dst), "--axis", "none", "--include", "layer.*", "--exclude", "*.k.*")
    assert out.returncode == 0, out.stderr
    got = engine.numpy.load_file(dst)
    assert got["layer.q.weight"].dtype == np.int8 and got["layer.q.weight.scale"].shape == ()  # per tensor
    assert got["layer.k.weight"].dtype == np.float32 and "layer.k.weight.scale" not in got  # excluded
    assert got["lm_head.weight"].dtype == np.float32  # not included
    out = run("quantize", str(src), str(dst), "--axis", "1")
    assert out.returncode == 0, out.stderr
    assert engine.numpy.load_file(dst)["lm_head.weight.scale"].shape == (6,)  # one scale per column

    tensors["layer.q.weight"][1, 2] = np.nan
    engine.numpy.save_file(tensors, src)
    before = dst.read_bytes()
    out = run("quantize", str(src), str(dst))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "layer.q.weight" in out.stderr
    assert dst.read_bytes() == before  # a failed run leaves the previous output intact
    out = run("quantize", str(src), str(dst), "--clamp")
    assert out.returncode == 0 and "layer.q.weight" in out.stdout
    out = run("quantize", str(src), str(dst), "--axis", "rows")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "'none'" in out.stderr


def test_bad_arguments_are_one_line():
    out = run("inspect")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and "required: path" in out.stderr


@pytest.mark.parametrize(
    "args", [["nope"], ["bench", "x", "--runs", "0"], ["inspect", "x", "--timeout", "soon"], []]
)
def test_bad_arguments_in_process(capsys, args):
    from engine.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


def test_bad_header_option(checkpoints):
    _, server, _ = checkpoints
    out = run("inspect", server.url("single/model.safetensors"), "--header", "no-colon")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Name: value" in out.stderr


def test_bench(checkpoints):
    root, _, _ = checkpoints
    out = run("bench", str(root / "sharded"), "--runs", "2", "--framework", "np", check=True)
    assert "engine mmap" in out.stdout and "engine pread" in out.stdout and "GB/s" in out.stdout
    assert "reference safetensors" in out.stdout and "1.00x" in out.stdout
    assert out.stderr == ""  # no progress bar when not on a terminal


# --------------------------------------------------------------------------- convert


def test_convert_shared_and_non_contiguous(tmp_path):
    torch = pytest.importorskip("torch")
    emb = torch.randn(10, 4)
    fused = torch.randn(12, 4)
    sd = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: the same view of the same memory
        "fused": fused,
        "q": fused[:4],  # a slice of another tensor: kept, as a copy
        "t": torch.randn(4, 6).t(),  # non-contiguous
        "step": 7,  # not a tensor: skipped
    }
    src = tmp_path / "pytorch_model.bin"
    torch.save(sd, src)
    dst = tmp_path / "model.safetensors"
    out = run("convert", str(src), str(dst))
    assert out.returncode == 0, out.stderr
    assert "lm_head.weight -> embed.weight" in out.stdout and "skipped 1 non-tensor" in out.stderr
    from safetensors import safe_open as ref_open

    with ref_open(str(dst), framework="pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "fused", "q", "t"]
        assert f.metadata() == {"format": "pt", "lm_head.weight": "embed.weight"}
        assert torch.equal(f.get_tensor("embed.weight"), emb)
        assert torch.equal(f.get_tensor("q"), fused[:4])
        assert torch.equal(f.get_tensor("t"), sd["t"])


# torch takes seconds to import: the variations below run main() in this process, which
# is what the subprocess runs too


def in_process(capsys, *args):
    from engine.commands.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_convert_legacy_format_and_wrapped_state_dict(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    w = torch.arange(6.0).reshape(2, 3)
    src = tmp_path / "old.pt"
    torch.save({"state_dict": {"w": w}, "epoch": 3}, src, _use_new_zipfile_serialization=False)
    code, _, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
    assert code == 0, err
    got = engine.numpy.load_file(tmp_path / "out.safetensors")
    np.testing.assert_array_equal(got["w"], w.numpy())


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_convert_refuses_code(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    src = tmp_path / "evil.bin"
    torch.save({"w": torch.zeros(2), "x": Evil()}, src)
    code, out, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
    assert code == 2 and "pwned" not in out
    assert err.count("\n") == 1 and "refusing" in err
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("content", [b"\x00garbage" * 10, b""])
def test_convert_not_a_checkpoint(tmp_path, capsys, content):
    pytest.importorskip("torch")
    src = tmp_path / "junk.bin"
    src.write_bytes(content)
    code, _, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
    assert code == 2 and err.count("\n") == 1
    code, _, err = in_process(capsys, "convert", str(tmp_path / "missing.bin"), str(tmp_path / "out.safetensors"))
    assert code == 2 and "missing.bin" in err


LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n")


def bad_inputs(tmp_path, good: bytes) -> dict:
    """name -> path of an input no command can read: missing, a directory, text, LFS pointer, truncated."""
    (tmp_path / "folder").mkdir()
    files = {
        "text.txt": b"hello world, this is text\n",
        "text.safetensors": b"hello world, this is text\n",
        "lfs.safetensors": LFS_POINTER,
        "truncated.safetensors": good[: len(good) // 2],
        "empty.safetensors": b"",
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    return {name: tmp_path / name for name in [*files, "folder", "missing.safetensors"]}


def one_line_error(code: int, err: str, path) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("engine ")
    assert str(path) in err


@pytest.mark.parametrize(
    "name", ["text.txt", "text.safetensors", "lfs.safetensors", "truncated.safetensors", "empty.safetensors",
             "folder", "missing.safetensors"]
)
def test_convert_bad_input_is_one_line(tmp_path, capsys, model, name):
    """torch.load of a text file raised KeyError from its unpickler, and of a .safetensors
    path the safetensors package's own error: tracebacks with exit 1."""
    pytest.importorskip("torch")
    src = bad_inputs(tmp_path, model.read_bytes())[name]
    code, _, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
    one_line_error(code, err, src)
    assert not (tmp_path / "out.safetensors").exists()
    if name.startswith("text"):
        assert "a text file" in err
    if name.startswith("lfs"):
        assert "Git LFS pointer" in err


def test_convert_truncated_torch_file(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    for legacy in (False, True):
        src = tmp_path / "model.bin"
        torch.save({"w": torch.randn(64, 64)}, src, _use_new_zipfile_serialization=not legacy)
        src.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
        code, _, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
        one_line_error(code, err, src)  # the zip reader said only "[Errno 22] Invalid argument"
        assert "InvalidCheckpoint" in err


def test_convert_a_safetensors_file(tmp_path, capsys, model):
    """A .safetensors source is read by the engine (torch.load would hand it to the reference)."""
    pytest.importorskip("torch")
    dst = tmp_path / "out.safetensors"
    code, out, err = in_process(capsys, "convert", str(model), str(dst))
    assert code == 0, err
    got, want = engine.numpy.load_file(dst), engine.numpy.load_file(model)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_output_in_a_missing_directory_names_it(tmp_path, capsys, model, command):
    if command == "convert":
        torch = pytest.importorskip("torch")
        src = tmp_path / "model.bin"
        torch.save({"w": torch.zeros(2)}, src)
    else:
        pytest.importorskip("numba", reason="quantization needs Numba (a test extra)")
        src = model
    folder = tmp_path / "no" / "such"
    code, _, err = in_process(capsys, command, str(src), str(folder / "out.safetensors"))
    one_line_error(code, err, folder)
    assert "output directory does not exist" in err and ".tmp" not in err
    (tmp_path / "adir").mkdir()
    code, _, err = in_process(capsys, command, str(src), str(tmp_path / "adir"))
    one_line_error(code, err, tmp_path / "adir")
    assert "is a directory" in err and ".tmp" not in err


@pytest.mark.parametrize("command", ["inspect", "validate", "stats", "quantize", "bench"])
@pytest.mark.parametrize(
    "name", ["text.safetensors", "lfs.safetensors", "truncated.safetensors", "empty.safetensors", "folder",
             "missing.safetensors"]
)
def test_every_command_bad_input_is_one_line(tmp_path, capsys, model, command, name):
    if command in ("stats", "quantize"):
        pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    src = bad_inputs(tmp_path, model.read_bytes())[name]
    args = {"quantize": [str(tmp_path / "q.safetensors")], "bench": ["--runs", "1", "--no-reference"]}
    code, out, err = in_process(capsys, command, str(src), *args.get(command, []))
    if command == "validate" and name not in ("folder", "missing.safetensors"):
        assert code == 1 and "problem: " in out and err == ""  # a broken file is a finding, not a failure
        return
    one_line_error(code, err, src)


def test_validate_broken_file_beside_a_config(tmp_path, capsys):
    """The weight checks ran on a file with format problems and ended in a second error (exit 2)."""
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10)))
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"hello world, this is text\n")
    code, out, err = in_process(capsys, "validate", str(src))
    assert code == 1 and err == "", err
    assert "problem: " in out and "weight checks: skipped" in out


@pytest.mark.parametrize("config", ["missing.json", "text.txt", "folder"])
def test_validate_bad_config_is_one_line_before_any_output(tmp_path, capsys, model, config):
    """The format checks printed their findings, then the config failed: output, then an error."""
    path = bad_inputs(tmp_path, model.read_bytes()).get(config, tmp_path / config)
    code, out, err = in_process(capsys, "validate", str(model), "--config", str(path))
    one_line_error(code, err, path)
    assert out == "" and "InvalidConfig" in err


def test_validate_counts_every_parameter(tmp_path, capsys):
    pytest.importorskip("numba", reason="the weight checks need Numba (a test extra)")
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10)))
    engine.numpy.save_file({"foo.weight": np.ones((512, 1024), np.float32)}, tmp_path / "model.safetensors")
    code, out, _ = in_process(capsys, "validate", str(tmp_path), "--config", str(tmp_path / "config.json"))
    assert code == 1
    assert "PROBLEMS - 524,288 parameters (0 in the tensors the config names" in out


def test_quantize_nonfinite_names_the_flag(tmp_path, capsys):
    pytest.importorskip("numba", reason="quantization needs Numba (a test extra)")
    a = np.ones((4, 4), np.float32)
    a[1, 1] = np.nan
    src = tmp_path / "nan.safetensors"
    engine.numpy.save_file({"w": a}, src)
    code, _, err = in_process(capsys, "quantize", str(src), str(tmp_path / "q.safetensors"))
    one_line_error(code, err, src)
    assert "--clamp" in err and "on_nonfinite" not in err and "1 NaN" in err and "'w'" in err


def test_console_script_entry_point(model):
    exe = shutil.which("engine")
    if exe is None:
        pytest.skip("the `engine` console script is not installed (pip install -e .)")
    out = subprocess.run([exe, "inspect", str(model)], capture_output=True, text=True)
    assert out.returncode == 0 and "a.weight" in out.stdout


# --------------------------------------------------------------------------- progress


@pytest.fixture
def three_shards(tmp_path):
    from engine.checkpoints.checkpoint import save_sharded

    rng = np.random.default_rng(0)
    save_sharded({f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(6)}, tmp_path / "ck",
                 max_shard_size="40KB")
    return tmp_path / "ck"


@pytest.mark.parametrize("command", ["stats", "quantize", "validate"])
def test_verbose_prints_a_line_per_file(three_shards, tmp_path, capsys, command):
    """stats, quantize and validate printed nothing until they finished."""
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10)))
    extra = {"quantize": [str(tmp_path / "q.safetensors")], "validate": ["--config", str(tmp_path / "config.json")]}
    code, _, err = in_process(capsys, command, str(three_shards), *extra.get(command, []), "--verbose")
    assert code == (1 if command == "validate" else 0), err
    lines = err.splitlines()
    assert lines == [f"engine {command}: {i}/3 model-0000{i}-of-00003.safetensors: 2 tensors, 32.77 KB"
                     for i in (1, 2, 3)]
    code, _, err = in_process(capsys, command, str(three_shards), *extra.get(command, []))
    assert err == ""  # quiet without --verbose, off a terminal


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", ["stats", "quantize"])
def test_progress_bar_on_a_terminal(three_shards, tmp_path, monkeypatch, capsys, command):
    pytest.importorskip("tqdm", reason="progress bars need tqdm (the cli extra)")
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    from engine.commands.cli import main

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = [str(tmp_path / "q.safetensors")] if command == "quantize" else []
    assert main([command, str(three_shards), *args]) == 0
    drawn = terminal.getvalue()
    assert f"\r{command}: " in drawn and "/98.3k [" in drawn  # a bar of the 6 x 16 KiB of tensors


def test_bench_times_the_touch_of_mapped_loads(model, monkeypatch, capsys):
    """A lazy mmap row read nothing and reported GB/s for it (608 GB/s)."""
    import engine.commands._cli_bench as bench

    touched = []
    real = bench._touch

    def spy(tensors):
        touched.append(sorted(tensors))
        return real(tensors)

    monkeypatch.setattr(bench, "_touch", spy)
    code, out, _ = in_process(capsys, "bench", str(model), "--runs", "2", "--framework", "np")
    assert code == 0
    assert touched == [["a.weight", "b"]] * 3  # the engine's mmap row: warm-up and 2 runs; numpy rows of
    # the reference's numpy rows are owned copies, not touched: each kind has its own table
    assert "mapped (lazy): every page faulted in" in out and "owned memory: every byte read" in out


def test_touch_reads_a_byte_of_every_page():
    from engine.commands._cli_bench import _touch

    a = np.zeros(3 * 4096 + 10, np.uint8)
    a[0], a[4096], a[8192], a[12288], a[-1] = 1, 2, 3, 4, 5
    b = np.zeros((2, 4096), np.float32)  # 32 KiB: its bytes at 0, 4096, ... are the first of each float
    b.reshape(-1)[::1024] = np.float32(np.frombuffer(b"\x07\x00\x00\x00", np.float32)[0])
    assert _touch({"a": a, "b": b, "empty": np.zeros((0, 3), np.float32)}) == 1 + 2 + 3 + 4 + 5 + 8 * 7


@pytest.mark.parametrize("command", ["quantize", "convert"])
def test_the_output_may_not_be_the_input(tmp_path, capsys, command):
    """`engine quantize m.safetensors m.safetensors` replaced the source weights by their int8
    form (atomically, and silently): the input and the output must differ."""
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)}, str(path))
    before = path.read_bytes()
    link = tmp_path / "alias.safetensors"
    os.symlink(path, link)
    for dst in (path, link):
        code, out, err = in_process(capsys, command, str(path), str(dst))
        assert code == 2 and "the output is the input file" in err and str(dst) in err, err
        assert len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before


# --------------------------------------------------------------------------- every command takes a URL

from servers import Nginx, nginx_or_skip  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A single-file and a sharded checkpoint under nginx, also as the bucket ``bucket`` of
    a path-style S3 endpoint (anonymous GETs of ``/bucket/key``)."""
    nginx_or_skip()
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(1)
    sd = {f"layers.{i}.weight": rng.standard_normal((8, 4 + i)).astype(np.float32) for i in range(4)}
    sd["embed"] = np.arange(40, dtype=np.int64).reshape(10, 4)
    (root / "bucket" / "single").mkdir(parents=True)
    engine.numpy.save_file(sd, root / "bucket" / "single" / "model.safetensors", metadata={"format": "np"})
    save_sharded(sd, root / "bucket" / "sharded", max_shard_size=300, metadata={"format": "np"})
    with Nginx(str(root)) as server:
        yield root / "bucket", server


def url_of(served, monkeypatch, scheme: str, where: str) -> str:
    _, server = served
    if scheme == "http":
        return server.url(f"bucket/{where}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.base)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull + "-none")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull + "-none")
    return f"s3://bucket/{where}"


# nginx answers path-style S3 GETs but no listing: S3 prefixes are tested against moto (test_s3.py)
@pytest.mark.parametrize("scheme, where", [
    ("http", "single/"), ("http", "sharded/"), ("http", "sharded/model.safetensors.index.json"),
    ("s3", "single/model.safetensors"), ("s3", "sharded/model.safetensors.index.json"),
])
def test_inspect_validate_and_stats_of_a_url_equal_the_local_path(served, monkeypatch, capsys, scheme, where):
    """`engine inspect` and `validate` of a folder URL answered 403 (HTTP); `stats` of any URL
    said `No such file or directory: 'http://...'`."""
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    folder, _ = served
    url = url_of(served, monkeypatch, scheme, where)
    local = str(folder / where.rstrip("/"))
    code, remote_out, err = in_process(capsys, "inspect", url)
    assert code == 0, err
    assert remote_out == in_process(capsys, "inspect", local)[1]
    code, out, err = in_process(capsys, "validate", url)
    assert code == 0 and out.rstrip().endswith("valid") and err == "", (out, err)
    code, out, err = in_process(capsys, "stats", url, "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(in_process(capsys, "stats", local, "--json")[1])


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_quantize_and_bench_of_a_folder_url(served, monkeypatch, capsys, tmp_path, scheme):
    """`quantize` and `bench` of any URL said `No such file or directory: 'http://...'`."""
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    folder, _ = served
    url = url_of(served, monkeypatch, scheme, "sharded/" if scheme == "http" else "sharded/model.safetensors.index.json")
    code, out, err = in_process(capsys, "quantize", url, str(tmp_path / "r.safetensors"))
    assert code == 0, err
    assert in_process(capsys, "quantize", str(folder / "sharded"), str(tmp_path / "l.safetensors"))[0] == 0
    got = engine.load_quantized(str(tmp_path / "r.safetensors"), dequantize=True)
    want = engine.load_quantized(str(tmp_path / "l.safetensors"), dequantize=True)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    code, out, err = in_process(capsys, "bench", url, "--runs", "1", "--framework", "np")
    assert code == 0, err
    assert "over the network" in out and "engine" in out and "5 tensors" in out


def test_validate_a_url_with_a_config_runs_the_weight_checks(served, capsys, tmp_path):
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    _, server = served
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=10)))
    code, out, err = in_process(capsys, "validate", server.url("bucket/single/"), "--config", str(config))
    assert code == 1 and err == "", err  # the toy tensors are not a LLaMA: the checks ran and found that
    assert f"weight checks against {config}:" in out and "skipped" not in out


def refused_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/model/"


@pytest.mark.parametrize("command", ["inspect", "validate", "stats", "quantize", "bench"])
@pytest.mark.parametrize("fault", ["refused", "404"])
def test_an_unreachable_or_missing_url_is_one_line_and_exit_2_at_once(served, capsys, tmp_path, command, fault):
    """`engine validate` of a refused connection or a 404 printed `invalid: 1 format problem(s)`
    on stdout and exited 1; a missing local path exits 2 with one line, and so must a URL."""
    import time

    if command in ("stats", "quantize"):
        pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    _, server = served
    url = refused_url() if fault == "refused" else server.url("bucket/nothing.safetensors")
    args = {"quantize": [str(tmp_path / "q.safetensors")], "bench": ["--runs", "1", "--no-reference"]}
    t0 = time.monotonic()
    code, out, err = in_process(capsys, command, url, *args.get(command, []))
    assert time.monotonic() - t0 < 2.0  # no silent retries of a refused connection
    one_line_error(code, err, url.rstrip("/"))
    assert out == ""
    assert ("Connection refused" if fault == "refused" else "not found (HTTP 404") in err


@pytest.mark.parametrize("command, args", [
    ("quantize", ["{src}", "http://127.0.0.1:9/out.safetensors"]),
    ("convert", ["{src}", "s3://bucket/out.safetensors"]),
    ("convert", ["https://example.invalid/pytorch_model.bin", "{dst}"]),
])
def test_a_command_that_cannot_work_on_a_url_says_so(model, tmp_path, capsys, command, args):
    args = [a.format(src=model, dst=tmp_path / "out.safetensors") for a in args]
    code, out, err = in_process(capsys, command, *args)
    url = next(a for a in args if "://" in a)
    one_line_error(code, err, url)
    assert "local file" in err and out == ""
    assert not (tmp_path / "out.safetensors").exists()


# --------------------------------------------------------------------------- version, help, metadata


def test_version(capsys):
    from engine import __version__
    from engine.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"engine (safetensors-engine) {__version__}"
    out = run("--version", check=True)
    assert out.stdout.strip() == f"engine (safetensors-engine) {__version__}"


def test_every_argument_has_help():
    import argparse

    from engine.commands.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in [("engine", parser), *sub.choices.items()]:
        for action in p._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help:
                missing.append(f"{name} {action.dest}")
    assert missing == []


def test_inspect_shows_the_quantization_record_readably(model, tmp_path, capsys):
    pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    dst = tmp_path / "q.safetensors"
    assert in_process(capsys, "quantize", str(model), str(dst))[0] == 0
    code, out, err = in_process(capsys, "inspect", str(dst))
    assert code == 0, err
    lines = out.splitlines()
    meta = lines[lines.index("metadata:") + 1:]
    assert "  format: np" in meta
    q = next(line for line in meta if line.startswith("  engine.quantization: "))
    assert "int8-symmetric, 1 tensors quantized (from F32: 1; scales axis 0: 1" in q and "\\" not in q
    assert len(q) < 160


@pytest.mark.parametrize("command", ["inspect", "validate", "stats", "quantize", "bench"])
def test_a_relative_path_is_shown_as_written(tmp_path, monkeypatch, capsys, command):
    """Errors named `./x.safetensors` in some commands and `x.safetensors` in others."""
    if command in ("stats", "quantize"):
        pytest.importorskip("numba", reason="the kernels need Numba (a test extra)")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.safetensors").write_text("hello world, this is text\n")
    args = {"quantize": ["q.safetensors"], "bench": ["--runs", "1", "--no-reference"]}
    code, out, err = in_process(capsys, command, "t.safetensors", *args.get(command, []))
    shown = out if command == "validate" else err
    assert "t.safetensors: the file is a text file" in shown and "./t.safetensors" not in shown


def test_convert_names_why_torch_refused_a_pickle(tmp_path, capsys):
    """torch's refusal opens with advice to load without weights_only; the line names the
    cause instead, and torch's warning about the pickle's protocol is not printed."""
    pytest.importorskip("torch")
    import pickle

    evil, plain = tmp_path / "evil.bin", tmp_path / "plain.bin"
    with open(evil, "wb") as f:
        pickle.dump({"x": Evil()}, f, protocol=4)
    with open(plain, "wb") as f:
        pickle.dump({"x": object()}, f, protocol=4)
    for src in (evil, plain):
        code, _, err = in_process(capsys, "convert", str(src), str(tmp_path / "out.safetensors"))
        assert code == 2 and err.count("\n") == 1, err
        assert err.rstrip().endswith("[UnsafePickle]") and "weights_only` set to `False`" not in err, err
        assert "Unsupported" in err, err  # torch's cause: an operand or a global it does not allow


def test_argument_errors_are_one_tagged_line_of_the_command_given(tmp_path):
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file({"a": np.zeros(3, np.float32)}, str(path))
    for args, who in ((["inspect", str(path), "--bogus"], "engine inspect"), (["nosuch"], "engine"),
                      (["inspect", str(path), "--timeout", "-1"], "engine inspect"),
                      (["bench", str(path), "--runs", "0"], "engine bench")):
        out = run(*args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"{who}: error:") and out.stderr.rstrip().endswith("[Usage]"), out.stderr


def test_a_warning_is_one_line_naming_the_command(tmp_path):
    """http.server ignores Range: the load warns once, in one line of the command's."""
    from servers import StdlibHTTP

    engine.numpy.save_file({"a": np.arange(50_000, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    with StdlibHTTP(str(tmp_path)) as srv:
        out = run("bench", srv.url("m.safetensors"), "--runs", "1", "--no-reference")
    lines = [x for x in out.stderr.splitlines() if "warning" in x.lower()]
    assert lines and all(x.startswith("engine bench: warning:") and x.endswith("[RangeIgnoredWarning]") for x in lines), \
        out.stderr
    assert "src.ranges" not in out.stderr  # no source line


# -- architectures the shape checks do not know ------------------------------------------------------


def _gpt2_checkpoint(folder) -> None:
    """A GPT-2 checkpoint as transformers saves it (its model and config.json), tiny; where
    transformers is not installed, the config.json and tensor names it writes."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 8, "n_head": 2, "n_layer": 2,
               "n_positions": 16, "vocab_size": 32}
        (folder / "config.json").write_text(json.dumps(cfg))
        rng = np.random.default_rng(0)
        t = {"transformer.wte.weight": (32, 8), "transformer.wpe.weight": (16, 8), "transformer.ln_f.weight": (8,),
             "transformer.ln_f.bias": (8,)}
        for i in range(2):
            p = f"transformer.h.{i}."
            t.update({p + "ln_1.weight": (8,), p + "ln_1.bias": (8,), p + "attn.c_attn.weight": (8, 24),
                      p + "attn.c_attn.bias": (24,), p + "attn.c_proj.weight": (8, 8), p + "attn.c_proj.bias": (8,),
                      p + "ln_2.weight": (8,), p + "ln_2.bias": (8,), p + "mlp.c_fc.weight": (8, 32),
                      p + "mlp.c_fc.bias": (32,), p + "mlp.c_proj.weight": (32, 8), p + "mlp.c_proj.bias": (8,)})
        engine.save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()},
                         folder / "model.safetensors", metadata={"format": "pt"})
        return
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=8, n_head=2, n_layer=2, n_positions=16, vocab_size=32))
    model.save_pretrained(folder, safe_serialization=True)


def test_validate_a_gpt2_checkpoint_skips_the_shape_checks_saying_why(tmp_path, capsys):
    from engine.commands.cli import main

    _gpt2_checkpoint(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    code = main(["validate", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "shape checks: skipped" in out and "'gpt2' is not an architecture the shape checks know" in out
    assert "header and data region valid" in out and "checksums: none recorded" in out
    assert out.splitlines()[-1] == "valid"

    code = main(["validate", str(tmp_path), "--no-config"])
    out = capsys.readouterr().out
    assert code == 0 and "shape checks: skipped (--no-config)" in out


def test_validate_reports_checksums_present_verified_and_mismatched(tmp_path, capsys):
    from engine.commands.cli import main
    from engine.format import checksums

    _gpt2_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    n = checksums.add_checksums(path)
    code = main(["validate", str(tmp_path), "--no-config"])
    out = capsys.readouterr().out
    assert code == 0 and f"{n} tensor(s) verified, 0 mismatched" in out
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # the last tensor's bytes
    path.write_bytes(raw)
    code = main(["validate", str(tmp_path), "--no-config"])
    out = capsys.readouterr().out
    assert code == 1 and f"{n - 1} tensor(s) verified, 1 mismatched" in out and "ChecksumMismatch" in out


def test_shape_checks_know_the_llama_family_only():
    from engine.apps.validator import shape_checks_skipped

    assert shape_checks_skipped({"model_type": "llama"}) is None
    llama = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=10)
    assert shape_checks_skipped(llama) is None
    for model_type in ("gpt2", "bert", "t5"):
        assert model_type in shape_checks_skipped({"model_type": model_type, **llama})
    assert "lacks" in shape_checks_skipped({"n_embd": 8})


def test_add_checksums_command_and_convert_checksums(tmp_path, capsys):
    from engine.format import checksums

    engine.numpy.save_file({"a": np.arange(10, dtype=np.float32), "b": np.ones(3, np.int8)}, tmp_path / "x.safetensors")
    code, out, err = in_process(capsys, "add-checksums", str(tmp_path))
    assert code == 0 and "each of 2 tensors" in out, err
    assert checksums.has_checksums(engine.read_header(str(tmp_path / "x.safetensors")))
    code, out, err = in_process(capsys, "add-checksums", str(tmp_path / "missing.safetensors"))
    assert code == 2 and err.count("\n") == 1
    torch = pytest.importorskip("torch", reason="convert reads torch.save files (torch is an extra)")
    torch.save({"w": torch.arange(6.0)}, tmp_path / "m.pt")
    code, out, err = in_process(capsys, "convert", str(tmp_path / "m.pt"), str(tmp_path / "m.safetensors"),
                                "--checksums")
    assert code == 0 and "CRC-32C" in out, err
    h = engine.read_header(str(tmp_path / "m.safetensors"))
    assert int(checksums.expected(h)[0]) == checksums.crc32c(torch.arange(6.0).numpy())


def test_add_checksums_on_a_folder_without_a_checkpoint_says_so_and_names_paths_as_given(tmp_path, capsys,
                                                                                          monkeypatch):
    """As every other command: ``[NoCheckpoint]`` and exit 2 for a folder with no safetensors
    file; an error about a file names it as the user typed it, not as an absolute path."""
    (tmp_path / "empty").mkdir()
    code, out, err = in_process(capsys, "add-checksums", str(tmp_path / "empty"))
    assert code == 2 and "[NoCheckpoint]" in err and str(tmp_path / "empty") in err, (code, out, err)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file at all")
    monkeypatch.chdir(tmp_path)
    code, out, err = in_process(capsys, "add-checksums", "bad.safetensors")
    assert code == 2 and err.split(": ")[2] == "bad.safetensors" and str(tmp_path) not in err, err


def test_validate_reports_a_header_that_fails_its_own_checksum(tmp_path, capsys):
    """A tensor renamed by a damaged byte (the JSON still parses) is a finding (exit 1), named,
    locally and over HTTP; not an error that ends the command."""
    src = tmp_path / "m.safetensors"
    engine.save_file({"weight": np.arange(6, dtype=np.float32)}, str(src), checksums=True)
    raw = bytearray(src.read_bytes())
    raw[raw.index(b'"weight"') + 1] ^= 0x01
    src.write_bytes(raw)
    code, out, err = in_process(capsys, "validate", str(src), "--no-config")
    assert code == 1 and err == "", err
    assert "HeaderChecksumMismatch" in out and "invalid:" in out
    with StdlibHTTP(str(tmp_path)) as srv:
        code, out, err = in_process(capsys, "validate", srv.url("m.safetensors"), "--no-config", "--timeout", "5")
    assert code == 1 and err == "", err
    assert "HeaderChecksumMismatch" in out
