"""engine.net._gcs and gs:// loads against GCS's XML API on 127.0.0.1 (tests/servers.py gcs_server,
``STORAGE_EMULATOR_HOST``): the bearer token checked, listing over several pages, credentials
from the environment (an access token, a user's refresh token, a service account's signed
assertion, the metadata server), and the retryable faults of the campaign retried."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import engine
import engine.numpy
from engine.errors import ReadError, RemoteFileNotFoundError, SafetensorError
from engine.net._gcs import GcsConfig, parse_listing, split_gs_url
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
import fault_campaign  # noqa: E402
from servers import gcs_server  # noqa: E402

TOKEN = "ya29.test-access-token"
BUCKET = "models"
_ENV = ("GOOGLE_OAUTH_ACCESS_TOKEN", "CLOUDSDK_AUTH_ACCESS_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
        "GCE_METADATA_HOST", "CLOUDSDK_CONFIG")


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    sd = {f"layers.{i}.w": rng.standard_normal((40, 32 + 8 * i)).astype(np.float32) for i in range(5)}
    sd["embed"] = rng.integers(-9, 9, (50, 4), dtype=np.int16)
    return sd


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``models/llama/`` (sharded, with its index), ``models/noindex/`` (the shards alone, and a
    file one level down), ``models/one/model.safetensors``; the campaign's checkpoint in the
    bucket ``campaign``."""
    root = tmp_path_factory.mktemp("gcs")
    sd = tensors()
    engine.save_sharded(sd, root / BUCKET / "llama", max_shard_size=9_000, fsync=False)
    os.makedirs(root / BUCKET / "noindex" / "nested")
    for p in (root / BUCKET / "llama").iterdir():
        if p.name.endswith(".safetensors"):
            (root / BUCKET / "noindex" / p.name).write_bytes(p.read_bytes())
    engine.numpy.save_file({"x": np.zeros(2, np.float32)}, str(root / BUCKET / "noindex" / "nested" / "a.safetensors"))
    os.makedirs(root / BUCKET / "one")
    engine.numpy.save_file(sd, str(root / BUCKET / "one" / "model.safetensors"))
    campaign = fault_campaign.make_checkpoint(str(root))
    server = gcs_server(str(root), token=TOKEN)
    yield server, sd, root, campaign
    server.stop()


@pytest.fixture
def gcs(served, monkeypatch):
    server = served[0]
    server.bulk()
    server.token, server.max_keys, server.refresh_token, server.public_key = TOKEN, 1000, None, None
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent-gcloud-config")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.base)
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", TOKEN)
    return server


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])


def test_gs_urls_name_a_bucket_and_a_key():
    assert split_gs_url("gs://b/a/model.safetensors") == ("b", "a/model.safetensors")
    assert split_gs_url("gs://b") == ("b", "")
    with pytest.raises(ReadError) as e:
        split_gs_url("gs:///key")
    assert e.value.reason == "InvalidURL"


def test_the_endpoint_and_the_token_come_from_the_environment(monkeypatch):
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent-gcloud-config")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    config = GcsConfig()
    assert config.http_url("b", "a b/c") == "https://storage.googleapis.com/b/a%20b/c"
    if not os.path.exists("/sys/class/dmi/id/product_name") or "Google" not in open(
            "/sys/class/dmi/id/product_name").read():
        assert not config.signed and config.headers(config.http_url("b", "k")) == {}
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    monkeypatch.setenv("CLOUDSDK_AUTH_ACCESS_TOKEN", "secret-token")
    config = GcsConfig()
    assert config.http_url("b", "k") == "http://localhost:4443/b/k"
    assert config.headers("http://localhost:4443/b/k") == {"Authorization": "Bearer secret-token"}
    assert config.headers("http://elsewhere:80/b/k") == {}  # the token goes to the endpoint only
    assert "secret-token" not in repr(config)


def test_a_listing_page_names_the_next(tmp_path):
    body = (b"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult xmlns='http://doc.s3.amazonaws.com/2006-03-01'>"
            b"<Name>b</Name><IsTruncated>true</IsTruncated><Contents><Key>a/x.safetensors</Key><Size>12</Size>"
            b"</Contents><Contents><Key>a/y.safetensors</Key><Size>5</Size></Contents></ListBucketResult>")
    assert parse_listing(body) == ([("a/x.safetensors", 12), ("a/y.safetensors", 5)], "a/y.safetensors")
    assert parse_listing(body.replace(b"true", b"false"))[1] is None


@pytest.mark.parametrize("where", ["llama/model.safetensors.index.json", "llama/", "llama", "noindex/",
                                   "one/model.safetensors"])
def test_a_load_with_a_token_equals_the_files(served, gcs, where):
    _, sd, _, _ = served
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/{where}"), sd)
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in gcs.requests)
    assert any(r["range"] for r in gcs.requests)  # ranged GETs on the engine's client, not fsspec


def test_a_prefix_listed_over_several_pages(served, gcs):
    _, sd, _, _ = served
    gcs.max_keys = 2
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/noindex"), sd)
    assert sum(1 for r in gcs.requests if r["range"] is None and "safetensors" not in r["path"]) >= 3


def test_safe_open_stream_and_inspect(served, gcs):
    _, sd, _, _ = served
    with engine.safe_open(f"gs://{BUCKET}/llama/", framework="np") as f:
        assert sorted(f.keys()) == sorted(sd)
        np.testing.assert_array_equal(f.get_slice("embed")[5:9], sd["embed"][5:9])
    _equal(dict(engine.stream(f"gs://{BUCKET}/llama/", framework="np")), sd)
    from engine.urls import remote

    info = remote.read_metadata(f"gs://{BUCKET}/llama/model.safetensors.index.json")
    assert sorted(info.weight_map) == sorted(sd)


def test_without_a_token_or_with_a_wrong_one_access_is_denied_naming_the_variables(gcs, monkeypatch):
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"gs://{BUCKET}/one/model.safetensors")
    assert e.value.reason == "AccessDenied" and e.value.status == 401
    assert "GOOGLE_OAUTH_ACCESS_TOKEN" in str(e.value) and f"gs://{BUCKET}/one/model.safetensors" in str(e.value)
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "wrong-token")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"gs://{BUCKET}/one/model.safetensors")
    assert e.value.status == 403 and "AccessDenied" in str(e.value) and "wrong-token" not in str(e.value)


def test_a_public_bucket_is_read_anonymously(served, gcs, monkeypatch):
    _, sd, _, _ = served
    gcs.token = None
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN")
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/llama/"), sd)
    assert all(r["authorization"] is None for r in gcs.requests)


def test_a_missing_object_is_not_found_naming_the_gs_url(gcs):
    with pytest.raises(RemoteFileNotFoundError, match=f"gs://{BUCKET}/nope.safetensors"):
        engine.numpy.load_file(f"gs://{BUCKET}/nope.safetensors")
    with pytest.raises(RemoteFileNotFoundError, match="no .safetensors"):
        engine.numpy.load_file(f"gs://{BUCKET}/empty-prefix/")


def test_a_users_refresh_token_is_exchanged_for_an_access_token(served, gcs, monkeypatch, tmp_path):
    _, sd, _, _ = served
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN")
    gcs.refresh_token = "1//refresh"
    adc = tmp_path / "gcloud"
    adc.mkdir()
    (adc / "application_default_credentials.json").write_text(json.dumps({
        "type": "authorized_user", "client_id": "id", "client_secret": "s", "refresh_token": "1//refresh",
        "token_uri": gcs.url("token")}))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(adc))
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/llama/"), sd)
    assert [r["method"] for r in gcs.requests].count("POST") == 1  # one exchange for the whole load


def test_a_service_accounts_key_signs_its_token_request(served, gcs, monkeypatch, tmp_path):
    pytest.importorskip("cryptography", reason="signing a service account's assertion needs cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    _, sd, _, _ = served
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    gcs.public_key = key.public_key()
    sa = tmp_path / "sa.json"
    sa.write_text(json.dumps({"type": "service_account", "client_email": "loader@p.iam.gserviceaccount.com",
                              "private_key_id": "k1", "private_key": pem, "token_uri": gcs.url("token")}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(sa))
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/llama/"), sd)
    # another key's assertion is refused by the token endpoint: an engine error, no token
    gcs.public_key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"gs://{BUCKET}/llama/")
    assert e.value.reason == "AccessDenied" and "token" in str(e.value)


def test_the_metadata_servers_token(served, gcs, monkeypatch):
    _, sd, _, _ = served
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN")
    monkeypatch.setenv("GCE_METADATA_HOST", gcs.base.split("://")[1])
    _equal(engine.numpy.load_file(f"gs://{BUCKET}/one/model.safetensors"), sd)
    assert gcs.requests[0]["path"] == "/computeMetadata/v1/instance/service-accounts/default/token"


def test_every_retryable_fault_of_the_campaign_is_retried(served, gcs):
    """Seeded transient faults (resets, short bodies, stalls, 500/503, SlowDown, another range,
    flipped bytes) on gs:// loads: each run is exact, or a named engine error after a permanent
    fault (the file changed, a compressed body)."""
    _, _, root, campaign = served
    options = {"timeout": 0.5, "retry": Retry(attempts=fault_campaign.MAX_IN_A_ROW + 2, base=0.005, cap=0.02)}
    gcs.stall = 0.8
    injected: dict[str, int] = {}
    for seed in range(12):
        faults = fault_campaign.Faults(100 + seed, 0.3, 0.01, str(root))
        gcs.faults_on, gcs.faults = "all", faults
        try:
            got = engine.numpy.load_file("gs://campaign/model.safetensors.index.json", **options)
        except SafetensorError:
            assert sum(faults.injected[k] for k in fault_campaign.PERMANENT), dict(faults.injected)
        else:
            _equal(got, campaign)
        for k, v in faults.injected.items():
            injected[k] = injected.get(k, 0) + v
    gcs.faults = {}
    assert set(fault_campaign.TRANSIENT) - {"flip"} <= set(injected), injected
