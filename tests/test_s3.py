"""engine.net._s3 and s3:// loads against moto's S3 server (tests/servers.py MotoS3):
credentials from the environment, SigV4 checked by the server, errors, listing a prefix."""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
import torch

import engine
import engine.torch
from engine.errors import ReadError, RemoteFileNotFoundError

sys.path.insert(0, os.path.dirname(__file__))
from servers import MotoS3, moto_available  # noqa: E402
from torch_models import assert_same, raw  # noqa: E402

if not moto_available():
    pytest.skip("moto's S3 server needs moto[server] and flask (a test extra)", allow_module_level=True)
pytest.importorskip("boto3", reason="uploading to moto needs boto3 (a test extra)")

INDEX = "model.safetensors.index.json"
BUCKET = "models"


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i in range(3):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(96, 96, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(192, 96, generator=g).to(torch.float16)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(96, generator=g)
    sd["model.position_ids"] = torch.arange(300)
    sd["model.empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    return sd


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{key: bytes}`` to upload: a sharded checkpoint with its index (llama/), the same
    shards without one (noindex/, plus a file one level down that must be ignored) and a
    single file (one/)."""
    root = tmp_path_factory.mktemp("s3")
    sd = state_dict()
    engine.save_sharded(sd, root / "sharded", max_shard_size=60_000, fsync=False)
    engine.save_sharded(sd, root / "one", fsync=False)
    out = {}
    for p in sorted((root / "sharded").iterdir()):
        out[f"llama/{p.name}"] = p.read_bytes()
        if p.name != INDEX:
            out[f"noindex/{p.name}"] = p.read_bytes()
    assert len(out) >= 6
    out["noindex/nested/model.safetensors"] = (root / "one" / "model.safetensors").read_bytes()
    out["one/model.safetensors"] = (root / "one" / "model.safetensors").read_bytes()
    return out, sd


def upload(client, files: dict, public: bool = False) -> None:
    client.create_bucket(Bucket=BUCKET)
    if public:  # anonymous clients may read and list, as on a public bucket
        client.put_bucket_policy(Bucket=BUCKET, Policy=json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"]}]}))
    for key, body in files.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)


@pytest.fixture(scope="module")
def moto(files):
    with MotoS3() as server:
        upload(server.client("s3"), files[0], public=True)
        yield server


@pytest.fixture(scope="module")
def moto_auth(files):
    with MotoS3(auth=True) as server:
        key, secret = server.issue_key()
        upload(server.client("s3", key, secret), {k: v for k, v in files[0].items() if k.startswith("llama/")})
        yield server, key, secret


def aws_env(monkeypatch, endpoint: str, key: str | None = None, secret: str | None = None) -> None:
    """Only the AWS_* variables set here count: no profile, no shared files."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    missing = os.path.join(os.path.dirname(__file__), "no-such-aws-file")
    monkeypatch.setenv("AWS_CONFIG_FILE", missing)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    if key is not None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret or "")


def text(err: BaseException) -> str:
    return "\n".join([str(err), repr(err), repr(err.args), "".join(traceback.format_exception(err))])


# -- credentials from the environment ----------------------------------------------------------------
@pytest.mark.parametrize("where", ["llama/", "llama", f"llama/{INDEX}", "one/model.safetensors", "one/", "noindex/"])
def test_a_load_with_credentials_from_the_environment_is_byte_exact(files, moto, monkeypatch, where):
    aws_env(monkeypatch, moto.endpoint, "testing", "testing")
    assert_same(engine.torch.load_file(f"s3://{BUCKET}/{where}"), files[1])


def test_the_right_key_is_accepted_by_a_server_that_checks_signatures(files, moto_auth, monkeypatch):
    server, key, secret = moto_auth
    aws_env(monkeypatch, server.endpoint, key, secret)
    sd = files[1]
    # an index, not the prefix: moto checks the signature of a listing against its query
    # decoded (prefix=llama/), where AWS and botocore sign it encoded (prefix=llama%2F), so
    # moto refuses boto3's own list_objects_v2(Prefix="llama/") too
    assert_same(engine.torch.load_file(f"s3://{BUCKET}/llama/{INDEX}"), sd)
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert sorted(engine.load_into(f"s3://{BUCKET}/llama/{INDEX}", dst, chunk_bytes=8192)) == sorted(sd)
    assert_same({k: dst[k] for k in sorted(dst)}, sd)


def test_a_wrong_secret_is_access_denied_and_named_nowhere(moto_auth, monkeypatch):
    server, key, secret = moto_auth
    wrong = "WRONG" + secret[5:]
    aws_env(monkeypatch, server.endpoint, key, wrong)
    with pytest.raises(ReadError) as err:
        engine.torch.load_file(f"s3://{BUCKET}/llama/{INDEX}")
    assert err.value.reason == "AccessDenied" and f"s3://{BUCKET}/llama/{INDEX}" in str(err.value)
    seen = text(err.value)
    assert wrong not in seen and secret not in seen and key not in seen


def test_unsigned_requests_are_refused_where_signatures_are_checked(moto_auth, monkeypatch):
    server, _, _ = moto_auth
    aws_env(monkeypatch, server.endpoint)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    with pytest.raises(ReadError):
        engine.torch.load_file(f"s3://{BUCKET}/llama/{INDEX}")


def test_anonymous_reads_of_a_public_bucket(files, moto, monkeypatch):
    aws_env(monkeypatch, moto.endpoint)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    assert_same(engine.torch.load_file(f"s3://{BUCKET}/one/model.safetensors"), files[1])
    monkeypatch.delenv("AWS_NO_SIGN_REQUEST")
    got = dict(engine.stream(f"s3://{BUCKET}/llama/", s3={"anonymous": True}, patterns=["*.up_proj.*"]))
    assert sorted(got) == [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]
    assert all(raw(v) == raw(files[1][k]) for k, v in got.items())


def test_s3_config_takes_the_environment(moto, monkeypatch):
    from engine.net._s3 import S3Config

    aws_env(monkeypatch, moto.endpoint, "AKIDENV", "SECRETENV")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    config = S3Config()
    assert config.signed and config.region == "eu-west-3" and config.endpoint == moto.endpoint
    assert config.http_url(BUCKET, "a b/c.safetensors") == f"{moto.endpoint}/{BUCKET}/a%20b/c.safetensors"
    signed = config.headers(config.http_url(BUCKET, "x"))
    assert "AKIDENV/" in signed["Authorization"] and "SECRETENV" not in str(signed)
    assert "SECRETENV" not in repr(config) and "AKIDENV" not in repr(config)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    aws = S3Config(region="us-west-2", anonymous=True)
    assert not aws.signed and aws.headers("https://x") == {}
    assert aws.http_url("bucket", "k") == "https://bucket.s3.us-west-2.amazonaws.com/k"
    assert aws.http_url("dotted.bucket", "k") == "https://s3.us-west-2.amazonaws.com/dotted.bucket/k"


# -- missing keys and listings -------------------------------------------------------------------------
def test_a_missing_key_is_not_found_naming_the_s3_url(moto, monkeypatch):
    aws_env(monkeypatch, moto.endpoint, "testing", "testing")
    url = f"s3://{BUCKET}/llama/absent.safetensors"
    with pytest.raises(RemoteFileNotFoundError) as err:
        engine.torch.load_file(url)
    assert url in str(err.value) and isinstance(err.value, FileNotFoundError)
    with pytest.raises(RemoteFileNotFoundError, match=f"s3://{BUCKET}/nothing-here/"):
        engine.torch.load_file(f"s3://{BUCKET}/nothing-here/")


def test_a_prefix_without_an_index_loads_every_file_right_under_it(files, moto, monkeypatch):
    """noindex/ holds the shards and, one level down, another file with the same names: the
    listing takes only the files right under the prefix (else the names would clash)."""
    aws_env(monkeypatch, moto.endpoint, "testing", "testing")
    from engine.urls.remote_load import open_parts

    with open_parts(f"s3://{BUCKET}/noindex/") as opened:
        shown = [p.path for p in opened.parts]
    assert shown == sorted(f"s3://{BUCKET}/{k}" for k in files[0] if k.startswith("noindex/") and k.count("/") == 1)
    with open_parts(f"s3://{BUCKET}/llama/") as opened:  # an index is preferred to the listing
        assert [p.path for p in opened.parts] == sorted(f"s3://{BUCKET}/{k}" for k in files[0]
                                                         if k.startswith("llama/") and k.endswith(".safetensors"))


def test_a_prefix_listed_over_several_pages_finds_the_shards_on_the_last(files, moto, monkeypatch):
    """1,000 other keys sort before the shards under paged/: the listing's first page (1,000
    keys) holds none of them, so the load needs the continuation token (also for a prefix
    named without its slash)."""
    from concurrent.futures import ThreadPoolExecutor

    aws_env(monkeypatch, moto.endpoint, "testing", "testing")
    client = moto.client("s3")
    shards = {k.removeprefix("noindex/"): v for k, v in files[0].items() if k.startswith("noindex/") and k.count("/") == 1}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=f"paged/a-{i:04d}.txt", Body=b"x"), range(1000)))
    for name, body in shards.items():
        client.put_object(Bucket=BUCKET, Key=f"paged/{name}", Body=body)
    from engine.urls.remote_load import open_parts

    with open_parts(f"s3://{BUCKET}/paged/") as opened:
        assert [p.path for p in opened.parts] == sorted(f"s3://{BUCKET}/paged/{n}" for n in shards)
    assert_same(engine.torch.load_file(f"s3://{BUCKET}/paged"), files[1])
