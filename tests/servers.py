"""Real servers on 127.0.0.1 for the remote tests and ``scripts/bench_remote.py``.

* :class:`Nginx`: Debian's nginx serving a directory with its own config in a temporary
  folder (sendfile, keep-alive, ETags and ``If-Match`` as nginx does them).  Also answers
  path-style S3 GETs (``/bucket/key``) of anonymous clients: the wire format of an S3 read.
* :class:`FuseMount`: bindfs (a FUSE file system in user space, Debian's ``bindfs``) showing
  a directory at another path, so that reads of its files cross the kernel's FUSE protocol
  to a daemon, as on gcsfuse, s3fs, blobfuse or JuiceFS (``/proc/self/mountinfo`` names it
  ``fuse``).
* :class:`StdlibHTTP`: the standard library's ``http.server`` (``python -m http.server``):
  it ignores Range (every GET is 200 with the whole file), sends ``Last-Modified`` and no
  ETag, redirects a folder without its slash and lists folders as HTML.  It counts the
  bytes it sends.
* :class:`MotoS3`: moto's S3 server (``moto.server.ThreadedMotoServer``) for S3 semantics:
  SigV4, errors, listing.  With ``auth=True`` it checks signatures against the access keys
  it issued (IAM), so a wrong secret is refused as by AWS.
* :class:`HubServer`: the Hugging Face Hub's API and ``resolve`` answers (302 to a CDN on
  another port that serves Range), gated repos checking the token.
* :func:`gcs_server`: GCS's XML API (bearer token checked, listing) on the range server of
  tests/rangeserver.py, with its faults.
* :func:`azure_server`: Azure's Blob API, Azurite-style, checking SharedKey signatures as the
  service computes them (or a SAS, or a bearer token), with the range server's faults.
* :class:`Azurite`: Microsoft's Azure Storage emulator (npm's ``azurite``), the real check of
  SharedKey signing.

Each is started by the test or benchmark that needs it and stopped when it ends; every
wait here is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )


def nginx_or_skip() -> str:
    """nginx's path, or skip the test saying why; with ``ENGINE_TESTS_REQUIRE_NGINX=1`` (set
    by CI, which installs nginx) a missing nginx fails the test instead."""
    import pytest

    binary = nginx_binary()
    if binary is None:
        why = "nginx is not installed (apt-get install nginx-light; CI installs it)"
        if os.environ.get("ENGINE_TESTS_REQUIRE_NGINX") == "1":
            pytest.fail(why + ", and ENGINE_TESTS_REQUIRE_NGINX=1 says these tests must run")
        pytest.skip(why)
    return binary


@contextlib.contextmanager
def nginx_serving(root, **kw):
    """:class:`Nginx` serving ``root`` while the block runs, after :func:`nginx_or_skip`."""
    nginx_or_skip()
    with Nginx(str(root), **kw) as server:
        yield server


def _wait_port(port: int, proc: subprocess.Popen, what: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {seconds} s")


class _ServerProcess:
    """A server run as a child process with a folder of its own: :meth:`stop` ends it (with
    ``STOP_SIGNAL``, then a kill) and removes the folder; a context manager around start/stop."""

    STOP_SIGNAL = signal.SIGTERM
    proc: subprocess.Popen | None
    dir: str

    def start(self):  # pragma: no cover - each server's own
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.STOP_SIGNAL)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Nginx(_ServerProcess):
    """nginx serving ``root`` on 127.0.0.1 (an ephemeral port), started by :meth:`start`."""

    STOP_SIGNAL = signal.SIGQUIT  # a graceful shutdown

    def __init__(self, root: str, *, workers: int = 2, tls: tuple[str, str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.workers = workers
        self.tls = tls  # (certificate, key) files: serve https
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.dir = tempfile.mkdtemp(prefix="engine-nginx-")

    @property
    def base(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}"

    def start(self) -> Nginx:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed")
        self.port = free_port()
        # a root master hands requests to workers of another user, who could not read the
        # 0600 files the engine writes: the workers run as this user
        user = "user root root;\n" if os.geteuid() == 0 else ""
        conf = os.path.join(self.dir, "nginx.conf")
        d = self.dir
        with open(conf, "w") as f:
            f.write(
                f"{user}worker_processes {self.workers};\ndaemon off;\npid {d}/nginx.pid;\n"
                f"error_log {d}/error.log warn;\n"
                "events { worker_connections 512; }\n"
                "http {\n"
                "  access_log off;\n  sendfile on;\n  tcp_nopush on;\n  keepalive_requests 100000;\n"
                "  keepalive_timeout 60s;\n"
                f"  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n"
                f"  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n"
                "  types { application/octet-stream safetensors; application/json json; }\n"
                "  default_type application/octet-stream;\n"
                f"  server {{\n    listen 127.0.0.1:{self.port}{' ssl' if self.tls else ''};\n    root {self.root};\n"
                + (f"    ssl_certificate {self.tls[0]};\n    ssl_certificate_key {self.tls[1]};\n" if self.tls else "")
                + "    location / { }\n  }\n}\n"
            )
        self.proc = subprocess.Popen([binary, "-c", conf, "-p", d, "-e", f"{d}/error.log"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_port(self.port, self.proc, "nginx")
        return self



def self_signed(folder: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, written to ``folder``: ``(cert, key)``
    paths (the certificate is its own authority: point ``SSL_CERT_FILE`` at it)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


class StdlibHTTP:
    """``http.server.SimpleHTTPRequestHandler`` serving ``root`` on 127.0.0.1 in a thread,
    unchanged but for counting: ``gets`` (request paths) and ``sent`` (bytes its socket
    accepted, headers included, per path)."""

    def __init__(self, root: str) -> None:
        import functools
        import http.server
        import threading

        counts = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def setup(self) -> None:
                super().setup()
                raw = self.wfile

                class Counting:
                    def write(self, data) -> int:
                        n = raw.write(data)
                        with counts.lock:
                            counts.sent[counts.current.get(threading.get_ident(), "")] = (
                                counts.sent.get(counts.current.get(threading.get_ident(), ""), 0) + len(data))
                        return n

                    def __getattr__(self, name):
                        return getattr(raw, name)

                self.wfile = Counting()

            def do_GET(self) -> None:
                with counts.lock:
                    counts.gets.append(self.path)
                    counts.current[threading.get_ident()] = self.path
                try:
                    super().do_GET()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up: what it cost is counted

        self.lock = threading.Lock()
        self.gets: list[str] = []
        self.sent: dict[str, int] = {}
        self.current: dict[int, str] = {}
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.httpd.daemon_threads = True
        # a short poll: stop() waits for the loop to see it
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{path}"

    def reset(self) -> None:
        with self.lock:
            self.gets.clear()
            self.sent.clear()

    def start(self) -> StdlibHTTP:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> StdlibHTTP:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def moto_available() -> bool:
    try:
        import flask  # noqa: F401  (moto's server runs on it)
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


class MotoS3:
    """moto's S3 server on 127.0.0.1, in a child process (its own interpreter, so its
    environment, such as ``INITIAL_NO_AUTH_ACTION_COUNT``, is its own).

    ``auth=True`` makes moto check each request's SigV4 signature against the IAM access
    keys it issued: :meth:`issue_key` creates a user with full S3 access and returns its
    ``(access key id, secret)``.
    """

    def __init__(self, *, auth: bool = False) -> None:
        self.auth = auth
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        self.port = free_port()
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("AWS_"):
                del env[k]
        if self.auth:
            # moto checks no request until it has counted this many (any key passes), then
            # every one: exactly the three IAM calls of issue_key, so that all later requests,
            # the test's set-up included, need a key moto issued (the root key "testing" is
            # then refused as unknown)
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from moto.server import main; sys.exit(main(sys.argv[1:]))",
             "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc, "moto's server", 30)
        return self

    def client(self, service: str, key: str = "testing", secret: str = "testing"):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def issue_key(self) -> tuple[str, str]:
        iam = self.client("iam")
        iam.create_user(UserName="engine")
        # an inline policy: moto loads AWS's managed policies (AmazonS3FullAccess) only on request
        policy = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
        iam.put_user_policy(UserName="engine", PolicyName="s3-all", PolicyDocument=policy)
        made = iam.create_access_key(UserName="engine")["AccessKey"]
        return made["AccessKeyId"], made["SecretAccessKey"]

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"), timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def fuse_or_skip() -> str:
    """bindfs's path, or skip the test saying why (no bindfs, no ``/dev/fuse``: a machine
    without FUSE cannot host the mount at all)."""
    import pytest

    binary = shutil.which("bindfs")
    if binary is None:
        pytest.skip("bindfs is not installed (apt-get install bindfs; CI installs it)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("this machine has no /dev/fuse, so no FUSE file system can be mounted")
    return binary


class FuseMount:
    """``bindfs SOURCE MOUNTPOINT`` (single-threaded daemon, no caching options), unmounted
    on exit.  Skips the test, saying why, where the mount is refused (no FUSE rights)."""

    def __init__(self, source: str, mountpoint: str) -> None:
        self.source, self.mountpoint = source, mountpoint

    def __enter__(self) -> FuseMount:
        import pytest

        binary = fuse_or_skip()
        os.makedirs(self.mountpoint, exist_ok=True)
        done = subprocess.run([binary, self.source, self.mountpoint], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            pytest.skip(f"bindfs could not mount here (exit {done.returncode}: {done.stderr.strip()[:200]})")
        return self

    def path(self, name: str) -> str:
        return os.path.join(self.mountpoint, name)

    def __exit__(self, *exc) -> None:
        for tool in (["fusermount3", "-u"], ["fusermount", "-u"], ["umount"]):
            if shutil.which(tool[0]) and subprocess.run([*tool, self.mountpoint], capture_output=True,
                                                        timeout=30).returncode == 0:
                return
        subprocess.run(["umount", "-l", self.mountpoint], capture_output=True, timeout=30)


def _expiring_handler():
    from rangeserver import _Handler

    class Handler(_Handler):
        """A CDN's presigned URLs: past its ``Expires`` a URL is refused (403), as a CDN does."""

        def do_GET(self) -> None:
            import urllib.parse

            expires = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("Expires")
            if expires and float(expires[0]) < time.time():
                self._record("GET")
                body = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                return self._status(403, body=body)
            super().do_GET()

    return Handler


class HubServer:
    """A Hugging Face Hub on 127.0.0.1, answering as the Hub does what a client of its files asks:

    * ``GET /api/{models,datasets}/{repo}/revision/{rev}``: ``{"id", "sha", "siblings": [{"rfilename"}],
      "gated", "private"}`` (``rev`` a branch, a tag or a commit, percent-encoded);
    * ``GET /{repo}/resolve/{rev}/{file}``: a ``.json`` answered by the Hub itself (200, ``ETag``,
      ``X-Repo-Commit``), a ``.safetensors`` (an LFS file) by a 302 to the CDN with ``X-Linked-Size``,
      ``X-Linked-Etag`` and ``X-Repo-Commit``, as the Hub answers whatever the ``Range``;
    * a gated repo's files, and everything of a private repo: 401 with ``X-Error-Code: GatedRepo``
      (``RepoNotFound`` for a private one) unless ``Authorization: Bearer <token>`` carries one of
      ``tokens`` (a gated repo's description is public, as on the Hub); an unknown repo 401
      (``RepoNotFound``) without a valid token and 404 with one, an unknown revision 404
      (``RevisionNotFound``), an unknown file 404 (``EntryNotFound``).

    The CDN (:attr:`cdn`) is a :class:`rangeserver.RangeServer` (or ``cdn``: nginx serving ``root``)
    on another port (another host as far as credentials go: ``Authorization`` must never reach it)
    serving each commit's files at
    ``/{sha}/{file}``; its requests, faults and records are the range server's, and it refuses a
    redirect's URL once its ``Expires`` (``ttl`` seconds after the redirect) has passed.  :attr:`requests`
    records the Hub's own: ``(path, Authorization)``.
    """

    def __init__(self, root: str, cdn: Any = None) -> None:
        import http.server
        import json
        import threading
        import urllib.parse

        from rangeserver import RangeServer

        self.root = root
        os.makedirs(root, exist_ok=True)
        # the CDN: a range server of its own, or a server of ``root`` the caller runs (nginx)
        self.own_cdn = cdn is None
        self.cdn = RangeServer(root) if cdn is None else cdn
        if cdn is None:
            self.cdn.RequestHandlerClass = _expiring_handler()
            self.cdn.start().bulk()
        #: seconds a redirect to the CDN is good for (its presigned ``Expires``)
        self.ttl = 3600.0
        self.repos: dict[str, dict] = {}
        self.blob_ids: dict[tuple[str, str], dict] = {}  # (commit, file) -> what the API's blobs=true adds
        self.tokens: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []
        self.answers: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # the head and the body are two writes: without TCP_NODELAY the body of an answer on a
            # reused connection waits for the client's delayed ACK (40 ms), which no Hub makes anyone wait
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
                with hub.lock:
                    hub.answers.append((self.path, code))
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def _error(self, code: int, error_code: str, message: str) -> None:
                self._send(code, json.dumps({"error": message}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": error_code, "X-Error-Message": message})

            def _repo(self, kind: str, repo_id: str, files: bool = True) -> dict | None:
                """The repo, or ``None`` after answering the refusal a client without access gets
                (a gated repo's description is public, its ``files`` are not)."""
                auth = self.headers.get("Authorization") or ""
                valid = auth.startswith("Bearer ") and auth[7:] in hub.tokens
                repo = hub.repos.get(f"{kind}/{repo_id}")
                if repo is None:
                    if valid:
                        self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
                    else:
                        self._error(401, "RepoNotFound", "Repository Not Found. Invalid username or password.")
                    return None
                if repo["private"] and not valid:
                    self._error(401, "RepoNotFound", "Repository Not Found. Invalid username or password.")
                    return None
                if repo["gated"] and files and not valid:
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                "to it and be authenticated to access it. Please log in.")
                    return None
                return repo

            def _sibling(self, sha: str, file: str) -> dict:
                """A file as the API lists it with ``blobs=true``: an LFS file (``.safetensors``) with
                its sha256, another with its git blob id."""
                out: dict = {"rfilename": file}
                if "blobs=true" in self.path:
                    out.update(hub.blob_ids[(sha, file)])
                return out

            def do_GET(self) -> None:
                with hub.lock:
                    hub.requests.append((self.path, self.headers.get("Authorization")))
                path = urllib.parse.urlsplit(self.path).path
                parts = path.lstrip("/").split("/")
                if parts[0] == "api" and len(parts) == 6 and parts[4] == "revision":
                    kind = parts[1][:-1]
                    repo = self._repo(kind, f"{parts[2]}/{parts[3]}", files=False)
                    if repo is None:
                        return
                    sha = repo["refs"].get(urllib.parse.unquote(parts[5]))
                    if sha is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[5]}")
                    body = json.dumps({"id": f"{parts[2]}/{parts[3]}", "sha": sha, "private": repo["private"],
                                       "gated": "manual" if repo["gated"] else False,
                                       "siblings": [self._sibling(sha, f) for f in sorted(repo["files"][sha])]})
                    return self._send(200, body.encode(), {"Content-Type": "application/json"})
                kind = "model"
                if parts[0] in ("datasets", "spaces"):
                    kind, parts = parts[0][:-1], parts[1:]
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._error(404, "EntryNotFound", "not a route of this Hub")
                repo = self._repo(kind, f"{parts[0]}/{parts[1]}")
                if repo is None:
                    return
                sha = repo["refs"].get(urllib.parse.unquote(parts[3]))
                file = urllib.parse.unquote("/".join(parts[4:]))
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
                if file not in repo["files"][sha]:
                    return self._error(404, "EntryNotFound", f"{file} does not exist on {parts[3]}")
                local = os.path.join(hub.root, sha, file)
                st = os.stat(local)
                etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
                common = {"X-Repo-Commit": sha, "ETag": etag}
                if file.endswith(".safetensors"):  # an LFS file: its bytes are the CDN's
                    expires = time.time() + hub.ttl
                    where = f"{hub.cdn.base}/{sha}/{urllib.parse.quote(file)}?Expires={expires:.3f}&Signature=abc"
                    return self._send(302, b"", {**common, "Location": where, "X-Linked-Etag": etag,
                                                 "X-Linked-Size": str(os.path.getsize(local))})
                with open(local, "rb") as f:
                    body = f.read()
                self._send(200, body, {**common, "Content-Type": "application/json"})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def add(self, repo_id: str, folder: str, *, gated: bool = False, private: bool = False, kind: str = "model",
            refs: tuple[str, ...] = ("main",)) -> str:
        """Publish every file under ``folder`` as a commit of ``repo_id``, which ``refs`` (branches,
        tags) then point at; returns the commit's sha."""
        import hashlib

        files = {}
        for dirpath, _, names in os.walk(folder):
            for n in names:
                full = os.path.join(dirpath, n)
                files[os.path.relpath(full, folder).replace(os.sep, "/")] = full
        digest = hashlib.sha1(repo_id.encode())
        for rel in sorted(files):
            with open(files[rel], "rb") as f:
                digest.update(rel.encode() + hashlib.sha1(f.read()).digest())
        sha = digest.hexdigest()
        for rel, full in files.items():
            digest1, digest256, size = hashlib.sha1(), hashlib.sha256(), os.path.getsize(full)
            digest1.update(b"blob %d\0" % size)
            with open(full, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest1.update(block)
                    digest256.update(block)
            self.blob_ids[(sha, rel)] = {"blobId": digest1.hexdigest()}
            if rel.endswith(".safetensors"):  # an LFS file: named by its sha256
                self.blob_ids[(sha, rel)]["lfs"] = {"sha256": digest256.hexdigest(), "size": size}
        for rel, full in files.items():  # the CDN's copy: a link to the file
            dest = os.path.join(self.root, sha, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not os.path.lexists(dest):
                os.symlink(os.path.abspath(full), dest)
        repo = self.repos.setdefault(f"{kind}/{repo_id}", {"refs": {}, "files": {}})
        repo["gated"], repo["private"] = gated, private
        repo["files"][sha] = set(files)
        repo["refs"][sha] = sha
        for ref in refs:
            repo["refs"][ref] = sha
        return sha

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.answers.clear()
        if self.own_cdn:
            self.cdn.bulk()

    def cdn_bytes(self) -> int:
        """Bytes of file bodies the CDN was asked for (every answer of a Range server in bulk mode
        sends what was asked)."""
        total = 0
        for r in self.cdn.requests:
            rng = r["range"] or ""
            a, _, b = rng[6:].partition("-")
            if a.isdigit() and b.isdigit():
                total += int(b) - int(a) + 1
            else:  # no range, or to the end: the whole file from there
                size = os.path.getsize(os.path.join(self.root, r["path"].lstrip("/")))
                total += size - (int(a) if a.isdigit() else 0)
        return total

    def start(self) -> HubServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.own_cdn:
            self.cdn.stop()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _object_keys(folder: str) -> list[str]:
    """Every file under ``folder`` as an object key (``/``-separated), sorted."""
    keys = []
    for dirpath, _, names in os.walk(folder):
        for n in names:
            keys.append(os.path.relpath(os.path.join(dirpath, n), folder).replace(os.sep, "/"))
    return sorted(keys)


def _jwt_valid(assertion: str, public_key, audience: str) -> bool:
    """Whether ``assertion`` is a service account's RS256 JWT for read access to storage,
    signed by the key of ``public_key``, for ``audience``, not expired."""
    import base64
    import json

    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    def unb64(text: str) -> bytes:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))

    try:
        head, claims, signature = assertion.split(".")
        public_key.verify(unb64(signature), f"{head}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
        doc = json.loads(unb64(claims))
    except (ValueError, InvalidSignature):
        return False
    return (json.loads(unb64(head)).get("alg") == "RS256" and doc.get("aud") == audience
            and "devstorage" in doc.get("scope", "") and doc.get("exp", 0) > time.time())


def _gcs_handler():
    import html
    import json
    import urllib.parse

    from rangeserver import _Handler

    class Handler(_Handler):
        """GCS's XML API: the bearer token checked, ``GET /bucket?prefix=&marker=`` listed,
        every object GET the range server's (its faults included)."""

        def _xml_error(self, code: int, name: str, message: str) -> None:
            body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{name}</Code>"
                    f"<Message>{message}</Message></Error>").encode()
            self._record("GET")
            self._status(code, body=body)

        def _json(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            """Google's token endpoint (``/token``): a refresh token or a service account's
            RS256 assertion, checked, exchanged for the server's access token."""
            server: Any = self.server
            self._record("POST")
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
            grant = form.get("grant_type", [""])[0]
            ok = False
            if grant == "refresh_token":
                ok = server.refresh_token is not None and form.get("refresh_token", [""])[0] == server.refresh_token
            elif grant == "urn:ietf:params:oauth:grant-type:jwt-bearer" and server.public_key is not None:
                ok = _jwt_valid(form.get("assertion", [""])[0], server.public_key, server.url("token"))
            if not ok:
                return self._json(400, {"error": "invalid_grant"})
            self._json(200, {"access_token": server.token, "expires_in": 3599, "token_type": "Bearer"})

        def do_GET(self) -> None:
            server = self.server
            if self.path == "/computeMetadata/v1/instance/service-accounts/default/token":
                self._record("GET")
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._json(403, {"error": "Missing Metadata-Flavor:Google header"})
                return self._json(200, {"access_token": server.token, "expires_in": 3599,  # type: ignore[attr-defined]
                                        "token_type": "Bearer"})
            auth = self.headers.get("Authorization")
            if server.token is not None and auth != f"Bearer {server.token}":  # type: ignore[attr-defined]
                if auth is None:
                    return self._xml_error(401, "AuthenticationRequired", "Authentication required.")
                return self._xml_error(403, "AccessDenied", "Access denied. Invalid credentials.")
            parts = urllib.parse.urlsplit(self.path)
            segments = parts.path.strip("/").split("/")
            if len(segments) == 1 and (parts.path.count("/") == 1 or parts.path.endswith("/")):
                return self._list(segments[0], urllib.parse.parse_qs(parts.query))
            super().do_GET()

        def _list(self, bucket: str, query: dict) -> None:
            folder = os.path.join(self.server.root, bucket)
            if not os.path.isdir(folder):
                return self._xml_error(404, "NoSuchBucket", "The specified bucket does not exist.")
            prefix = query.get("prefix", [""])[0]
            marker = query.get("marker", [""])[0]
            keys = [k for k in _object_keys(folder) if k.startswith(prefix) and k > marker]
            page = keys[: self.server.max_keys]  # type: ignore[attr-defined]
            truncated = len(keys) > len(page)
            items = "".join(f"<Contents><Key>{html.escape(k)}</Key><Generation>1</Generation>"
                            f"<Size>{os.path.getsize(os.path.join(folder, k))}</Size></Contents>" for k in page)
            nxt = f"<NextMarker>{html.escape(page[-1])}</NextMarker>" if truncated else ""
            body = ("<?xml version='1.0' encoding='UTF-8'?><ListBucketResult xmlns='http://doc.s3.amazonaws.com/"
                    f"2006-03-01'><Name>{bucket}</Name><Prefix>{html.escape(prefix)}</Prefix><Marker>"
                    f"{html.escape(marker)}</Marker>{nxt}<IsTruncated>{str(truncated).lower()}</IsTruncated>{items}"
                    "</ListBucketResult>").encode()
            self._record("GET")
            self.send_response(200)
            self.send_header("Content-Type", "application/xml; charset=UTF-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def gcs_server(root: str, token: str | None = None):
    """GCS's XML API on 127.0.0.1 (for ``STORAGE_EMULATOR_HOST``): a
    :class:`rangeserver.RangeServer` (its modes, faults and records) serving the files under
    ``root/{bucket}/`` as ``/{bucket}/{key}``, that refuses a request without ``Authorization:
    Bearer {token}`` (401 ``AuthenticationRequired``, a wrong one 403 ``AccessDenied``, as GCS
    does) and lists ``GET /{bucket}?prefix=&marker=`` (``max_keys`` a page).  It is also
    Google's token endpoint (``POST /token``: ``refresh_token`` or a service account's assertion
    checked against ``public_key``) and the metadata server's token (``GCE_METADATA_HOST``).
    Started; call ``stop()``."""
    from rangeserver import RangeServer

    server = RangeServer(root)
    server.RequestHandlerClass = _gcs_handler()
    server.token = token  # type: ignore[attr-defined]
    server.max_keys = 1000  # type: ignore[attr-defined]
    server.refresh_token = None  # type: ignore[attr-defined]  # what /token exchanges for the token
    server.public_key = None  # type: ignore[attr-defined]  # a service account's, checking its assertions
    return server.start().bulk()


def azure_shared_key(method: str, target: str, headers, account: str, key: bytes) -> str:
    """The SharedKey signature of a request as the Blob service computes it (version
    2015-02-21 and later): HMAC-SHA256 with the account key over the method, the eleven
    standard headers by position (``Content-Length`` empty when 0), the ``x-ms-`` headers
    (lowercased, sorted, ``name:value``), then ``/{account}{path}`` and the query's parameters
    (lowercased names, sorted, decoded values, repeated ones comma-joined)."""
    import base64
    import hashlib
    import hmac
    import urllib.parse

    h = {k.lower(): v.strip() for k, v in headers.items()}
    names = ("content-encoding", "content-language", "content-length", "content-md5", "content-type", "date",
             "if-modified-since", "if-match", "if-none-match", "if-unmodified-since", "range")
    fields = [method] + ["" if n == "content-length" and h.get(n) == "0" else h.get(n, "") for n in names]
    canonical_headers = "".join(f"{k}:{h[k]}\n" for k in sorted(k for k in h if k.startswith("x-ms-")))
    path, _, query = target.partition("?")
    resource = f"/{account}{path}"
    params: dict[str, list[str]] = {}
    for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True):
        params.setdefault(k.lower(), []).append(v)
    for k in sorted(params):
        resource += f"\n{k}:{','.join(sorted(params[k]))}"
    text = "\n".join(fields) + "\n" + canonical_headers + resource
    return base64.b64encode(hmac.new(key, text.encode(), hashlib.sha256).digest()).decode()


def _azure_handler():
    import email.utils
    import html
    import urllib.parse

    from rangeserver import _Handler

    class Handler(_Handler):
        """Azure's Blob API, Azurite-style (``/{account}/{container}/{blob}``): each request's
        credentials checked (SharedKey's signature and date, a SAS's signature, a bearer
        token), ``?restype=container&comp=list`` listed, every blob GET the range server's."""

        def _refuse(self, code: int, name: str, detail: str) -> None:
            body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{name}</Code><Message>Server failed '
                    f"to authenticate the request.</Message><AuthenticationErrorDetail>{html.escape(detail)}"
                    "</AuthenticationErrorDetail></Error>").encode()
            self._record("GET")
            self._status(code, {"x-ms-error-code": name}, body=body)

        def _authorized(self) -> bool:
            server: Any = self.server
            auth = self.headers.get("Authorization") or ""
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            if not self.headers.get("x-ms-version"):
                self._refuse(400, "MissingRequiredHeader", "x-ms-version is required")
                return False
            if auth.startswith("SharedKey ") and server.key is not None:
                account, _, mac = auth[len("SharedKey "):].partition(":")
                sent = self.headers.get("x-ms-date") or self.headers.get("Date") or ""
                try:
                    age = abs(time.time() - email.utils.parsedate_to_datetime(sent).timestamp())
                except (TypeError, ValueError):
                    age = 1e9
                want = azure_shared_key("GET", self.path, dict(self.headers.items()), account, server.key)
                if account == server.account and mac == want and age < 900:
                    return True
                self._refuse(403, "AuthenticationFailed", f"The MAC signature found in the HTTP request '{mac}' "
                             "is not the same as any computed signature.")
                return False
            if auth.startswith("Bearer ") and server.bearer is not None:
                if auth[7:] == server.bearer:
                    return True
                self._refuse(401, "InvalidAuthenticationInfo", "the bearer token is not valid")
                return False
            if "sig" in query and server.sas is not None:
                if query["sig"] == urllib.parse.parse_qs(server.sas)["sig"]:
                    return True
                self._refuse(403, "AuthenticationFailed", "Signature did not match.")
                return False
            if server.public:
                return True
            self._refuse(404 if not auth else 403, "ResourceNotFound" if not auth else "AuthenticationFailed",
                         "no credentials")  # Azure hides a private blob from anonymous clients
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            parts = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(parts.query)
            if query.get("comp") == ["list"] and query.get("restype") == ["container"]:
                return self._list(parts.path.strip("/"), query)
            super().do_GET()

        def _list(self, where: str, query: dict) -> None:
            folder = os.path.join(self.server.root, where)
            if not os.path.isdir(folder):
                return self._refuse(404, "ContainerNotFound", "The specified container does not exist.")
            prefix = query.get("prefix", [""])[0]
            marker = query.get("marker", [""])[0]
            keys = [k for k in _object_keys(folder) if k.startswith(prefix) and (not marker or k >= marker)]
            page, rest = keys[: self.server.max_keys], keys[self.server.max_keys:]  # type: ignore[attr-defined]
            items = "".join(f"<Blob><Name>{html.escape(k)}</Name><Properties><Content-Length>"
                            f"{os.path.getsize(os.path.join(folder, k))}</Content-Length><BlobType>BlockBlob"
                            "</BlobType></Properties></Blob>" for k in page)
            body = (f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="{self.server.base}/"'
                    f' ContainerName="{html.escape(where)}"><Prefix>{html.escape(prefix)}</Prefix><Blobs>{items}'
                    f"</Blobs><NextMarker>{html.escape(rest[0]) if rest else ''}</NextMarker></EnumerationResults>"
                    ).encode()
            self._record("GET")
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def azure_server(root: str, account: str = "devstoreaccount1", key: bytes | None = None):
    """Azure's Blob API on 127.0.0.1 as Azurite serves it (``/{account}/{container}/{blob}``, the
    files under ``root/{account}/``): a :class:`rangeserver.RangeServer` (its modes, faults and
    records) that checks every request's SharedKey signature with ``key`` (as the service
    computes it, :func:`azure_shared_key`), or a SAS whose ``sig`` is ``sas``'s, or the bearer
    token ``bearer``; anonymous requests only where ``public``.  Lists with ``max_keys`` a page.
    Started; call ``stop()``."""
    from rangeserver import RangeServer

    server = RangeServer(root)
    server.RequestHandlerClass = _azure_handler()
    server.account, server.key = account, key  # type: ignore[attr-defined]
    server.sas = server.bearer = None  # type: ignore[attr-defined]
    server.public = False  # type: ignore[attr-defined]
    server.max_keys = 5000  # type: ignore[attr-defined]
    return server.start().bulk()


def azurite_or_skip() -> str:
    """``azurite-blob``'s path (Microsoft's Azure Storage emulator, from npm), or skip the test
    saying why; with ``ENGINE_TESTS_REQUIRE_AZURITE=1`` a missing Azurite fails it instead."""
    import pytest

    binary = shutil.which("azurite-blob")
    if binary is None:
        why = "Azurite is not installed (npm install -g azurite)"
        if os.environ.get("ENGINE_TESTS_REQUIRE_AZURITE") == "1":
            pytest.fail(why + ", and ENGINE_TESTS_REQUIRE_AZURITE=1 says these tests must run")
        pytest.skip(why)
    return binary


class Azurite(_ServerProcess):
    """Azurite's blob service on 127.0.0.1 (an ephemeral port), its data in a temporary folder:
    the account ``devstoreaccount1`` with its well-known key, SharedKey checked as Azure does.
    :meth:`put` uploads a blob with a request signed by :func:`azure_shared_key`."""

    ACCOUNT = "devstoreaccount1"
    KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

    def __init__(self) -> None:
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.dir = tempfile.mkdtemp(prefix="engine-azurite-")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.ACCOUNT}"

    def start(self) -> Azurite:
        binary = azurite_or_skip()
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                                      "--location", self.dir, "--silent"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc, "Azurite", 60)
        return self

    def put(self, path: str, body: bytes = b"", query: str = "", headers: dict | None = None) -> int:
        """``PUT {endpoint}/{path}?{query}`` signed with the account key: the answer's status."""
        import base64
        import email.utils
        import http.client

        target = f"/{self.ACCOUNT}/{path}" + (f"?{query}" if query else "")
        h = {"x-ms-version": "2021-08-06", "x-ms-date": email.utils.formatdate(time.time(), usegmt=True),
             "Content-Length": str(len(body)), **(headers or {})}
        h["Authorization"] = f"SharedKey {self.ACCOUNT}:" + azure_shared_key(
            "PUT", target, h, self.ACCOUNT, base64.b64decode(self.KEY))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("PUT", target, body=body, headers=h)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

