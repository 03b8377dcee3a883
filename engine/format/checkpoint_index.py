"""The index of a sharded checkpoint, ``model.safetensors.index.json``, read and checked.

    {"metadata": {"total_size": 123}, "weight_map": {"tensor name": "shard file name", ...}}

The index is checked as strictly as a header: it must be a JSON object without duplicate
keys whose ``weight_map`` maps strings to strings; every shard name stays inside the
index's directory (no ``..``, no absolute path, no URL); every tensor the index lists is in
its shard, every tensor of a shard is in the index, and no name is in two shards
(:func:`index_problems`).  :mod:`engine.checkpoints.checkpoint` opens the shards it names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.base._files import open_regular
from engine.errors import CheckpointIndexError

if TYPE_CHECKING:
    from engine.format.header import Header

__all__ = ["check_shard_name", "parse_index", "index_problems", "read_index"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_shard_name(name: object, *, source: str | None = None) -> str:
    """Check that a shard name from an index stays inside the index's directory.

    Parameters
    ----------
    name : object
        A value of the index's ``weight_map``.
    source : str, optional
        The index, for messages.

    Returns
    -------
    str
        ``name``, unchanged: a relative path with ``/`` separators.

    Raises
    ------
    CheckpointIndexError
        ``reason="UnsafeShardName"``: empty, absolute (``/x``, ``C:\\x``), a URL or any
        ``scheme:``, a ``..`` or ``.`` component, a backslash, a NUL or a control character.

    Notes
    -----
    The check is lexical.  Symbolic links are followed as usual: the Hugging Face cache
    stores every shard as a link into its ``blobs/`` folder.
    """
    if not isinstance(name, str):
        raise CheckpointIndexError(
            f"shard names must be strings, got {type(name).__name__} {name!r}", reason="InvalidIndex", path=source
        )

    def unsafe(why: str) -> CheckpointIndexError:
        return CheckpointIndexError(f"shard name {name!r} {why}", reason="UnsafeShardName", path=source)

    if not name:
        raise unsafe("is empty")
    if _CONTROL.search(name):
        raise unsafe("holds a control character")
    if "\\" in name:
        raise unsafe("holds a backslash, which is a separator on Windows")
    if name.startswith("/") or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", name):
        raise unsafe("is absolute or a URL; shard names are relative to the index's directory")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise unsafe("has an empty, '.' or '..' component; shards must lie in the index's directory")
    return name


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def parse_index(data: bytes | str, *, source: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and check the JSON of a ``*.safetensors.index.json``.

    Parameters
    ----------
    data : bytes or str
        The whole index file.
    source : str, optional
        Its path or URL, for messages.

    Returns
    -------
    metadata : dict
        The index's ``metadata`` object (``{}`` when absent), e.g. ``{"total_size": ...}``.
    weight_map : dict of str to str
        Tensor name to shard name, in the index's order.

    Raises
    ------
    CheckpointIndexError
        ``InvalidIndex``: not UTF-8 JSON, a duplicate key anywhere, not an object,
        ``weight_map`` missing or not an object of strings, ``metadata`` not an object;
        ``UnsafeShardName``: see :func:`check_shard_name`.

    Notes
    -----
    Keys other than ``metadata`` and ``weight_map`` are ignored, as Hugging Face loaders do.
    """

    def invalid(message: str) -> CheckpointIndexError:
        return CheckpointIndexError(message, reason="InvalidIndex", path=source)

    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        import json  # only for an index: opening one file needs no JSON decoder beyond the header's

        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise invalid(f"the index is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except _DuplicateKey as exc:
        raise invalid(f"the index has the key {exc.args[0]!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise invalid(f"the index is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid(f"the index must be a JSON object, got {type(doc).__name__}")
    if "weight_map" not in doc:
        raise invalid("the index has no 'weight_map'")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise invalid(f"'weight_map' must be an object of tensor names to shard names, got {type(weight_map).__name__}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointIndexError(
                f"'weight_map' maps {name!r} to {shard!r}; shard names must be strings",
                reason="InvalidIndex",
                path=source,
                tensors=(name,),
            )
    for shard in set(weight_map.values()):
        check_shard_name(shard, source=source)
    metadata = doc.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise invalid(f"'metadata' must be an object, got {type(metadata).__name__}")
    return metadata, weight_map


def index_problems(
    weight_map: Mapping[str, str], headers: Mapping[str, Header], source: str | None
) -> list[CheckpointIndexError]:
    """Every disagreement between an index and its shards' headers.

    Parameters
    ----------
    weight_map : mapping of str to str
        The index's tensor name -> shard name.
    headers : mapping of str to Header
        Shard name -> its header, for every shard the index names.
    source : str or None
        The index, for messages.

    Returns
    -------
    list of CheckpointIndexError
        Empty when they agree; else one error per kind of disagreement (``TensorNotInShard``,
        ``TensorNotInIndex``, ``DuplicateTensor``), each naming the tensors involved.
    """
    problems: list[CheckpointIndexError] = []
    where: dict[str, list[str]] = {}
    for shard, header in headers.items():
        for name in header.names:
            where.setdefault(name, []).append(shard)
    for name, shards in where.items():
        if len(shards) > 1:
            problems.append(
                CheckpointIndexError(
                    f"tensor {name!r} is in {len(shards)} shards: {', '.join(map(repr, shards))}",
                    reason="DuplicateTensor",
                    path=source,
                    tensors=(name,),
                )
            )
    for name, shard in weight_map.items():
        if shard not in headers:
            continue  # a missing shard is reported on its own
        if name not in headers[shard]:
            actual = [s for s in where.get(name, ()) if s != shard]
            hint = f"; it is in {actual[0]!r}" if actual else ""
            problems.append(
                CheckpointIndexError(
                    f"the index places tensor {name!r} in {shard!r}, which does not hold it{hint}",
                    reason="TensorNotInShard",
                    path=source,
                    tensors=(name,),
                )
            )
    for shard, header in headers.items():
        extra = [n for n in header.names if n not in weight_map]
        if extra:
            shown = ", ".join(map(repr, extra[:5])) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            problems.append(
                CheckpointIndexError(
                    f"shard {shard!r} holds tensors the index does not list: {shown}",
                    reason="TensorNotInIndex",
                    path=source,
                    tensors=extra,
                )
            )
    return problems


def read_index(path: str, max_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Read and check the index file at ``path`` (at most ``max_size`` bytes): (metadata, weight_map)."""
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_size:
            raise CheckpointIndexError(
                f"the index is {size} bytes, more than the limit of {max_size} (raise max_header_size)",
                reason="InvalidIndex",
                path=path,
            )
        data = f.read(max_size + 1)
    return parse_index(data, source=path)
