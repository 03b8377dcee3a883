"""engine.net._azure and az:// loads against Azure's Blob API on 127.0.0.1 (tests/servers.py
azure_server, Azurite-style endpoints from a connection string): SharedKey signatures checked as
the service computes them, a SAS, a bearer token, listing over several pages, and the
retryable faults of the campaign retried."""

from __future__ import annotations

import base64
import os
import sys

import numpy as np
import pytest

import engine
import engine.numpy
from engine.errors import ReadError, RemoteFileNotFoundError, SafetensorError
from engine.net._azure import AzureConfig, parse_listing, split_az_url, string_to_sign
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
import fault_campaign  # noqa: E402
from servers import azure_server, azure_shared_key  # noqa: E402

ACCOUNT = "devstoreaccount1"
KEY = base64.b64encode(b"an account key of 32 bytes......").decode()
CONTAINER = "models"
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_TOKEN")


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(13)
    sd = {f"blocks.{i}.w": rng.standard_normal((36, 30 + 6 * i)).astype(np.float32) for i in range(5)}
    sd["ids"] = np.arange(77, dtype=np.int64)
    return sd


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``models/llama/`` (sharded with its index), ``models/noindex/`` (the shards alone),
    ``models/one/model.safetensors``, and the campaign's checkpoint in the container
    ``campaign``, all under the account's folder."""
    root = tmp_path_factory.mktemp("azure")
    sd = tensors()
    acct = root / ACCOUNT
    engine.save_sharded(sd, acct / CONTAINER / "llama", max_shard_size=9_000, fsync=False)
    os.makedirs(acct / CONTAINER / "noindex")
    for p in (acct / CONTAINER / "llama").iterdir():
        if p.name.endswith(".safetensors"):
            (acct / CONTAINER / "noindex" / p.name).write_bytes(p.read_bytes())
    os.makedirs(acct / CONTAINER / "one")
    engine.numpy.save_file(sd, str(acct / CONTAINER / "one" / "model.safetensors"))
    campaign = fault_campaign.make_checkpoint(str(acct))
    server = azure_server(str(root), ACCOUNT, base64.b64decode(KEY))
    yield server, sd, acct, campaign
    server.stop()


@pytest.fixture
def azure(served, monkeypatch):
    """The server checking SharedKey; the connection string Azurite's users write."""
    server = served[0]
    server.bulk()
    server.key, server.sas, server.bearer, server.public, server.max_keys = base64.b64decode(KEY), None, None, False, 5000
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};"
                       f"AccountKey={KEY};BlobEndpoint={server.base}/{ACCOUNT};")
    return server


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])


def test_az_urls_name_a_container_and_a_blob():
    assert split_az_url("az://c/a/model.safetensors") == ("c", "a/model.safetensors")
    with pytest.raises(ReadError) as e:
        split_az_url("az:///blob")
    assert e.value.reason == "InvalidURL"


def test_the_string_to_sign_is_the_services():
    """The example of Azure's documentation of SharedKey (a ranged GET with If-Match and a
    query), field by field."""
    got = string_to_sign("GET", "http://127.0.0.1:10000/devstoreaccount1/c/a%20b?comp=metadata&timeout=20",
                         {"Range": "bytes=0-7", "If-Match": '"0x1"', "x-ms-version": "2021-08-06",
                          "X-MS-Date": "Fri, 26 Jun 2015 23:39:12 GMT", "User-Agent": "u", "Content-Length": "0"},
                         "devstoreaccount1")
    want = ("GET\n\n\n\n\n\n\n\n\"0x1\"\n\n\nbytes=0-7\nx-ms-date:Fri, 26 Jun 2015 23:39:12 GMT\n"
            "x-ms-version:2021-08-06\n/devstoreaccount1/devstoreaccount1/c/a%20b\ncomp:metadata\ntimeout:20")
    assert got == want


def test_the_account_endpoint_and_credentials_come_from_the_environment(monkeypatch):
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ReadError, match="AZURE_STORAGE_ACCOUNT"):
        AzureConfig(url="az://c/b")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "acct")
    config = AzureConfig()
    assert config.http_url("c", "d/e.safetensors") == "https://acct.blob.core.windows.net/c/d/e.safetensors"
    assert config.headers(config.http_url("c", "k")) == {"x-ms-version": "2021-08-06"} and not config.signed
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?sv=2021&sig=secret%2B")
    config = AzureConfig()
    assert config.http_url("c", "k") == "https://acct.blob.core.windows.net/c/k?sv=2021&sig=secret%2B"
    assert "secret" not in repr(config)
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    config = AzureConfig()
    url = config.http_url("c", "k")
    signed = config.headers(url, {"Range": "bytes=0-7"})
    assert signed["Authorization"] == f"SharedKey acct:{azure_shared_key('GET', '/c/k', {**signed, 'Range': 'bytes=0-7'}, 'acct', base64.b64decode(KEY))}"
    assert "Authorization" not in config.headers("https://elsewhere.example/c/k", {})
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    assert AzureConfig().endpoint == "http://127.0.0.1:10000/devstoreaccount1"


def test_a_listing_page_names_the_next():
    body = (b'<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs><Blob><Name>a/x.safetensors</Name>'
            b"<Properties><Content-Length>12</Content-Length></Properties></Blob></Blobs><NextMarker>m2</NextMarker>"
            b"</EnumerationResults>")
    assert parse_listing(body) == ([("a/x.safetensors", 12)], "m2")
    assert parse_listing(body.replace(b"m2", b""))[1] is None


@pytest.mark.parametrize("where", ["llama/model.safetensors.index.json", "llama/", "llama", "noindex/",
                                   "one/model.safetensors"])
def test_a_load_signed_with_the_shared_key_equals_the_files(served, azure, where):
    _, sd, _, _ = served
    _equal(engine.numpy.load_file(f"az://{CONTAINER}/{where}"), sd)
    assert all((r["authorization"] or "").startswith(f"SharedKey {ACCOUNT}:") for r in azure.requests)
    assert any(r["range"] for r in azure.requests) and any(r["if_match"] for r in azure.requests)


def test_account_and_key_variables_a_prefix_over_several_pages(served, azure, monkeypatch):
    """A connection string that names the endpoint and no credential takes ``AZURE_STORAGE_KEY``."""
    _, sd, _, _ = served
    azure.max_keys = 2
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};BlobEndpoint={azure.base}/{ACCOUNT}")
    with pytest.raises(RemoteFileNotFoundError):  # anonymous: Azure hides a private container
        engine.numpy.load_file(f"az://{CONTAINER}/noindex/")
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    _equal(engine.numpy.load_file(f"az://{CONTAINER}/noindex"), sd)
    assert sum(1 for r in azure.requests if r["range"] is None) >= 3


def test_a_wrong_key_is_access_denied_naming_the_url_and_the_variables(azure, monkeypatch):
    wrong = base64.b64encode(b"another key of 32 bytes.........").decode()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};AccountKey={wrong};"
                       f"BlobEndpoint={azure.base}/{ACCOUNT}")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"az://{CONTAINER}/one/model.safetensors")
    msg = str(e.value)
    assert e.value.reason == "AccessDenied" and e.value.status == 403 and "AuthenticationFailed" in msg
    assert f"az://{CONTAINER}/one/model.safetensors" in msg and "AZURE_STORAGE_KEY" in msg and wrong not in msg


def test_a_sas_token(served, azure, monkeypatch):
    _, sd, _, _ = served
    azure.sas = "sv=2021-08-06&sr=c&sp=rl&sig=c2lnbmF0dXJl%2B"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};BlobEndpoint={azure.base}/{ACCOUNT}")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?" + azure.sas)
    _equal(engine.numpy.load_file(f"az://{CONTAINER}/llama/"), sd)
    assert all(r["authorization"] is None for r in azure.requests)
    with pytest.raises(RemoteFileNotFoundError) as e:
        engine.numpy.load_file(f"az://{CONTAINER}/llama/missing.safetensors")
    assert "c2lnbmF0dXJl" not in str(e.value)  # the SAS is a secret: no message holds it
    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};BlobEndpoint={azure.base}/{ACCOUNT};"
                       "SharedAccessSignature=sv=2021-08-06&sig=d3Jvbmc%3D")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"az://{CONTAINER}/llama/")
    assert e.value.status == 403 and "d3Jvbmc" not in str(e.value)


def test_a_bearer_token(served, azure, monkeypatch):
    _, sd, _, _ = served
    azure.key, azure.bearer = None, "eyJ0eXAi.token"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};BlobEndpoint={azure.base}/{ACCOUNT}")
    monkeypatch.setenv("AZURE_STORAGE_TOKEN", azure.bearer)
    _equal(engine.numpy.load_file(f"az://{CONTAINER}/llama/"), sd)
    assert all(r["authorization"] == f"Bearer {azure.bearer}" for r in azure.requests)
    monkeypatch.setenv("AZURE_STORAGE_TOKEN", "expired")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file(f"az://{CONTAINER}/llama/")
    assert e.value.status == 401 and "expired" not in str(e.value)


def test_a_public_container_is_read_anonymously(served, azure, monkeypatch):
    _, sd, _, _ = served
    azure.public = True
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};BlobEndpoint={azure.base}/{ACCOUNT}")
    _equal(engine.numpy.load_file(f"az://{CONTAINER}/llama/"), sd)
    assert all(r["authorization"] is None for r in azure.requests)


def test_an_azure_https_url_is_read_with_the_accounts_credentials_only(monkeypatch):
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "mine")
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    mine = AzureConfig(endpoint="https://mine.blob.core.windows.net")
    assert mine.how == "SharedKey" and mine.account == "mine"
    other = AzureConfig(endpoint="https://theirs.blob.core.windows.net")
    assert other.how == "anonymous" and other.account == "theirs"
    assert other.http_url("c", "m.safetensors") == "https://theirs.blob.core.windows.net/c/m.safetensors"


def test_safe_open_stream_and_read_metadata(served, azure):
    _, sd, _, _ = served
    with engine.safe_open(f"az://{CONTAINER}/llama/", framework="np") as f:
        assert sorted(f.keys()) == sorted(sd)
        np.testing.assert_array_equal(f.get_slice("ids")[10:20], sd["ids"][10:20])
    _equal(dict(engine.stream(f"az://{CONTAINER}/llama/", framework="np")), sd)
    from engine.urls import remote

    info = remote.read_metadata(f"az://{CONTAINER}/llama/model.safetensors.index.json")
    assert sorted(info.weight_map) == sorted(sd)


def test_every_retryable_fault_of_the_campaign_is_retried(served, azure):
    """Seeded transient faults on az:// loads, each request signed again on each try: each run
    is exact, or a named engine error after a permanent fault."""
    _, _, _, campaign = served
    options = {"timeout": 0.5, "retry": Retry(attempts=fault_campaign.MAX_IN_A_ROW + 2, base=0.005, cap=0.02)}
    azure.stall = 0.8
    injected: dict[str, int] = {}
    for seed in range(12):
        faults = fault_campaign.Faults(200 + seed, 0.3, 0.01, str(served[0].root))
        azure.faults_on, azure.faults = "all", faults
        try:
            got = engine.numpy.load_file("az://campaign/model.safetensors.index.json", **options)
        except SafetensorError:
            assert sum(faults.injected[k] for k in fault_campaign.PERMANENT), dict(faults.injected)
        else:
            _equal(got, campaign)
        for k, v in faults.injected.items():
            injected[k] = injected.get(k, 0) + v
    azure.faults = {}
    assert set(fault_campaign.TRANSIENT) - {"flip"} <= set(injected), injected


def test_azurite_accepts_the_engines_signed_requests(tmp_path, monkeypatch):
    """Against Microsoft's own emulator: blobs uploaded with requests signed as the service
    computes SharedKey, then loaded through az:// with ``UseDevelopmentStorage=true``."""
    from servers import Azurite

    sd = tensors()
    engine.save_sharded(sd, tmp_path / "ckpt", max_shard_size=9_000, fsync=False)
    with Azurite() as azurite:
        assert azurite.put("models", query="restype=container") == 201
        for p in sorted((tmp_path / "ckpt").iterdir()):
            assert azurite.put(f"models/llama/{p.name}", p.read_bytes(), headers={"x-ms-blob-type": "BlockBlob"}) == 201
        for k in _ENV:
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true;"
                           f"DevelopmentStorageProxyUri=http://127.0.0.1:{azurite.port}")
        _equal(engine.numpy.load_file("az://models/llama/"), sd)
        with engine.safe_open("az://models/llama/model.safetensors.index.json", framework="np") as f:
            np.testing.assert_array_equal(f.get_slice("ids")[3:9], sd["ids"][3:9])
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName={ACCOUNT};AccountKey={KEY};"
                           f"BlobEndpoint={azurite.endpoint}")
        with pytest.raises(ReadError) as e:  # another key: Azurite refuses the signature
            engine.numpy.load_file("az://models/llama/")
        assert e.value.status == 403 and e.value.reason == "AccessDenied"
