"""A seeded fault campaign against the engine's one HTTP client, through every entry point.

A Range server (tests/rangeserver.py, keep-alive, ETags) misbehaves at random: each GET of a
file draws, from a seed and the request's identity (its path, first byte and how many times
that range was asked for), whether it fails and how.  Transient faults (a reset mid-body, a
body closed early, a stall past the timeout, 500, 503, 503 with ``Retry-After: 0``, S3's
``SlowDown``, a well-formed answer for another range, a flipped byte in a file's header or a
whole tensor's bytes, both recorded in the file's checksums)
never strike one range more than :data:`MAX_IN_A_ROW` times running: a retry mends each.
Permanent faults (the file's ETag changes, a body compressed against ``identity``) end a run
with a named error.

Every run loads through one entry point (HTTP, and the same files as an anonymous S3 bucket)
and is classified: ``exact`` (the file's bytes),
``permanent`` (a named error, after a permanent fault), ``gave_up`` (an error after transient
faults only: the client failed to mend what a retry mends), ``wrong_bytes``, ``foreign`` (an
exception outside the engine's hierarchy) or ``hung`` (past :data:`RUN_LIMIT`).  Used by
tests/test_remote_faults.py (a short run in CI) and scripts/fault_campaign.py (160 runs and more).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections import Counter

import numpy as np

TRANSIENT = ("reset", "short", "slow", "500", "503", "503-retry", "slowdown", "other-range", "flip")
PERMANENT = ("change", "gzip")
#: the most faults one range meets running (its tries: Retry(attempts) must exceed it)
MAX_IN_A_ROW = 3
#: seconds one run may take before it counts as hung
RUN_LIMIT = 60.0
ENTRY_POINTS = ("load_file(index)", "load_file(shard)", "stream", "get_tensor", "get_slice",
                "urls.get_tensor", "cache_dir", "s3 load_file(index)")


def make_checkpoint(root: str) -> dict:
    """Three shards and their index, written with per-tensor checksums: the expected arrays."""
    import engine
    import engine.numpy

    rng = np.random.default_rng(3)
    tensors = {f"layers.{i}.w": rng.standard_normal((64, 96 + 8 * i), dtype=np.float32) for i in range(6)}
    tensors.update({f"layers.{i}.b": rng.integers(-9, 9, 200 + i, dtype=np.int16) for i in range(6)})
    folder = os.path.join(root, "campaign")
    os.makedirs(folder, exist_ok=True)
    engine.save_sharded(tensors, folder, max_shard_size=70_000, checksums=True)
    return tensors


class Faults:
    """The server's ``faults`` callable: a fault per GET, drawn from the seed and the request's
    identity; ``rate`` the chance of a transient fault, ``permanent`` of a permanent one.
    ``injected`` counts what was drawn by kind."""

    def __init__(self, seed: int, rate: float, permanent: float, root: str, flips: bool = True) -> None:
        self.seed, self.rate, self.permanent, self.root = seed, rate, permanent, root
        self.flips = flips
        self.asked: Counter = Counter()
        self.row: Counter = Counter()
        self.injected: Counter = Counter()
        self.lock = threading.Lock()
        self.ends: dict[str, int] = {}

    def _data_start(self, path: str) -> int:
        if path not in self.ends:
            with open(os.path.join(self.root, path.lstrip("/")), "rb") as f:
                self.ends[path] = 8 + struct.unpack("<Q", f.read(8))[0]
        return self.ends[path]

    def __call__(self, n: int, path: str, first: int | None, last: int | None) -> str | None:
        with self.lock:
            key = (path, first)
            k = self.asked[key]
            self.asked[key] += 1
            digest = hashlib.sha256(f"{self.seed}:{path}:{first}:{k}".encode()).digest()
            draw = int.from_bytes(digest[:8], "little") / 2.0**64
            pick = digest[8]
            kind = None
            if draw < self.permanent:
                kind = PERMANENT[pick % len(PERMANENT)]
            elif draw < self.permanent + self.rate and self.row[key] < MAX_IN_A_ROW:
                kinds = list(TRANSIENT)
                data = path.endswith(".safetensors") and first is not None and first >= self._data_start(path)
                if not path.endswith(".safetensors") or (data and not self.flips):
                    # the index records no checksum of itself; a slice of a tensor has none of
                    # its own to catch a damaged byte (a header and a whole tensor do)
                    kinds.remove("flip")
                if first is None:
                    kinds.remove("other-range")
                kind = kinds[pick % len(kinds)]
            self.row[key] = self.row[key] + 1 if kind in TRANSIENT else 0
            if kind is not None:
                self.injected[kind] += 1
            return kind


def _load(entry: str, base: str, tensors: dict, options: dict, scratch: str, shard: str) -> dict:
    """The arrays one entry point returns for the campaign's checkpoint."""
    import engine
    import engine.numpy
    from engine.urls import remote

    index = f"{base}/campaign/model.safetensors.index.json"
    names = sorted(tensors)
    if entry == "load_file(index)":
        return engine.numpy.load_file(index, **options)
    if entry == "load_file(shard)":
        return engine.numpy.load_file(f"{base}/campaign/{shard}", **options)
    if entry == "stream":
        return dict(engine.stream(index, framework="np", **options))
    if entry == "get_tensor":
        with engine.safe_open(index, framework="np", **options) as f:
            return {n: f.get_tensor(n) for n in names[::3]}
    if entry == "get_slice":
        with engine.safe_open(index, framework="np", **options) as f:
            return {n: f.get_slice(n)[1:3] for n in names[1::4]}
    if entry == "urls.get_tensor":
        return {n: remote.get_tensor(index, n, timeout=options["timeout"], retry=options["retry"])
                for n in names[2::5]}
    if entry == "s3 load_file(index)":  # the same files as an anonymous path-style S3 bucket, signed requests off
        s3 = {"endpoint_url": base, "anonymous": True}
        return engine.numpy.load_file("s3://campaign/model.safetensors.index.json", s3=s3, **options)
    if entry == "cache_dir":
        return engine.numpy.load_file(index, cache_dir=os.path.join(scratch, "cache"), **options)
    raise ValueError(entry)


def _expected(entry: str, tensors: dict, got: dict) -> dict:
    if entry == "get_slice":
        return {n: tensors[n][1:3] for n in got}
    return {n: tensors[n] for n in got}


def _wanted(entry: str, tensors: dict) -> int | None:
    names = sorted(tensors)
    return {"load_file(index)": len(names), "stream": len(names), "cache_dir": len(names),
            "s3 load_file(index)": len(names),
            "get_tensor": len(names[::3]), "get_slice": len(names[1::4]),
            "urls.get_tensor": len(names[2::5])}.get(entry)


def run(server, root: str, tensors: dict, *, seed: int, runs: int, rates=(0.05, 0.3), permanent: float = 0.01,
        entries=ENTRY_POINTS, scratch: str, log=None) -> dict:
    """``runs`` runs, round-robin over ``entries``, each with its own fault rate (evenly from
    ``rates[0]`` to ``rates[1]``) and seed (``seed + run``).  Returns the counts by outcome and
    by entry point, the faults injected by kind, the retries and the file descriptors left."""
    from engine.errors import SafetensorError
    from engine.net.retry import Retry


    outcomes: Counter = Counter()
    by_entry: dict[str, Counter] = {e: Counter() for e in entries}
    injected: Counter = Counter()
    details: list[str] = []
    fds_before = _fds()
    options = {"timeout": 0.5, "retry": Retry(attempts=MAX_IN_A_ROW + 2, base=0.005, cap=0.02)}
    server.stall = 0.8  # past the timeout: a stalled answer times out
    shard = sorted(f for f in os.listdir(os.path.join(root, "campaign")) if f.startswith("model-"))[0]
    for i in range(runs):
        entry = entries[i % len(entries)]
        rate = rates[0] + (rates[1] - rates[0]) * (i / max(1, runs - 1))
        faults = Faults(seed + i, rate, permanent, root, flips=entry != "get_slice")
        server.faults_on, server.faults = "all", faults
        result: dict = {}

        def one(entry=entry, i=i, result=result) -> None:
            try:
                result["got"] = _load(entry, server.base, tensors, options, os.path.join(scratch, f"run{i}"), shard)
            except BaseException as exc:  # classified below
                result["error"] = exc

        t = threading.Thread(target=one, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(RUN_LIMIT)
        permanent_faults = sum(faults.injected[k] for k in PERMANENT)
        if t.is_alive():
            outcome = "hung"
        elif "error" in result:
            err = result["error"]
            if not isinstance(err, SafetensorError):
                outcome = "foreign"
            elif permanent_faults:
                outcome = "permanent"
            else:
                outcome = "gave_up"
            if outcome != "permanent":
                details.append(f"run {i} ({entry}, rate {rate:.2f}, faults {dict(faults.injected)}): "
                               f"{type(err).__name__}: {err}")
        else:
            got = result["got"]
            want = _expected(entry, tensors, got)
            exact = all(np.array_equal(np.asarray(got[n]), want[n]) for n in got) and \
                (_wanted(entry, tensors) is None or len(got) == _wanted(entry, tensors)) and len(got) > 0
            outcome = "exact" if exact else "wrong_bytes"
            if not exact:
                details.append(f"run {i} ({entry}): wrong bytes, faults {dict(faults.injected)}")
        outcomes[outcome] += 1
        by_entry[entry][outcome] += 1
        injected.update(faults.injected)
        if log is not None:
            log(f"run {i:3d} {entry:18s} rate {rate:.2f} {outcome:11s} {time.monotonic() - t0:5.2f} s "
                f"faults {dict(faults.injected)}")
    server.faults = {}
    fds_after = _fds()
    deadline = time.monotonic() + 3 * server.stall
    while set(fds_after) - set(fds_before) and time.monotonic() < deadline:
        # the server's own handlers (in this process) close their side of the last connections
        time.sleep(0.05)
        fds_after = _fds()
    return {"outcomes": dict(outcomes), "by_entry": {e: dict(c) for e, c in by_entry.items()},
            "injected": dict(injected), "details": details,
            "fds_left": sorted(fds_after[k] for k in set(fds_after) - set(fds_before))}


def _fds() -> dict[str, str]:
    """This process's open file descriptors and what each is."""
    out = {}
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return out
