"""Tensor-parallel loads from a URL: each rank requests only the byte ranges of its shards.

``engine.load_tensor_parallel(url, plan, ...)`` in direct mode comes here.  The reads are
planned as for a local file (:func:`engine.parallel.tp_direct.direct_jobs`): a replicated tensor or a
block of rows is one range of the file, received straight into the rank's shard; a column
block is one request per group of neighbouring rows (:func:`engine.net.views.read_runs`:
the bytes between a rank's runs within a group are received into a scratch buffer and
dropped, so a rank receives about its share plus the gaps of at most ``max_gap`` between
its runs).  The requests of every file share the load's connections.  Tensors the plan
cannot read in place (packed sub-byte dtypes, padded or fused splits along another
dimension) are read whole through a :class:`~engine.urls.remote_handle.RemoteHandle` and cut in
memory.
"""

from __future__ import annotations

from typing import Any

from engine.base._threads import map_threads
from engine.net.views import read_runs
from engine.parallel.tp_direct import direct_jobs
from engine.parallel.tp_slices import shard_of
from engine.planning.sharding_plan import ShardingPlan
from engine.urls.remote_handle import RemoteHandle
from engine.urls.remote_load import open_parts

__all__ = ["load_remote_direct"]


def load_remote_direct(url: str, plan: ShardingPlan, rank: int, world_size: int, *, device: Any,
                       names=None, connections: int | None = None, **remote) -> dict:
    """This rank's shards of every tensor at ``url`` (a file, an index or a prefix).

    ``remote`` takes the options of :func:`engine.urls.remote_load.open_parts` (``headers``,
    ``timeout``, ``retry``, ``s3``, ``cache_dir`` ...).  With ``cache_dir``, a file whose
    current copy is there is read from it; a file this rank receives whole (a world of one,
    or a plan that replicates it) gets its copy once the load succeeded.

    Copies of tensor bytes: 1 on the CPU (socket to the shard), plus the host-to-device copy
    for a device (file by file, so host memory holds one file's shards at most).
    """
    out: dict = {}
    with open_parts(url, connections=connections, **remote) as opened:
        opened.ranged()  # a file's local copy (cache_dir) is read by positional reads
        handle = None
        for part in opened.parts:
            outputs, jobs, slow = direct_jobs(part.header, plan, rank, world_size, names, "spans")
            # a job is runs of one tensor's shard; one run is one request
            map_threads(lambda job, part=part: read_runs(part.ranges, job.dst, job.src, job.run_bytes, job.base),
                        jobs, opened.reads.connections, name="engine-tp")
            if slow:
                handle = handle or RemoteHandle.of_parts(opened, url, "pt")
                for name in slow:
                    outputs[name] = shard_of(handle, name, plan.action(name), rank, world_size)
            order = {n: i for i, n in enumerate(part.header.offset_keys())}
            for name, tensor in sorted(outputs.items(), key=lambda kv: order[kv[0]]):
                out[name] = tensor if str(device) == "cpu" else tensor.to(device)
        opened.commit()  # the copies of the files this rank received whole (cache_dir)
    return out
