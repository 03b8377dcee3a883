"""Which rows of which files a load's selection names (``names``, ``patterns``,
``predicate``, ``layers``): one file's by :func:`engine.planning.plan.select_rows`; across
the shards of a checkpoint, each name and pattern must be found in some file, and each file
reads the part of the selection it holds.
"""

from __future__ import annotations

from engine.errors import SafetensorError, TensorNotFoundError
from engine.format.header import Header
from engine.planning.plan import select_rows

__all__ = ["select_file", "select_files"]


def select_files(headers: list[Header], paths: list[str], names, patterns, predicate, layers) -> list[list[int]]:
    """Per-file rows for a selection over several files; each name and pattern must be
    found in some file."""
    import fnmatch

    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        known = set().union(*(h.table.index for h in headers))
        missing = [n for n in names if n not in known]
        if missing:
            raise TensorNotFoundError(f"no tensor {missing[0]!r} to select in {len(paths)} files", tensors=missing)
    if patterns is not None:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for h in headers for n in h.table.names):
                raise TensorNotFoundError(f"pattern {pattern!r} matches no tensor", tensors=(pattern,))
    out = []
    for h, p in zip(headers, paths, strict=True):
        mine = None if names is None else [n for n in names if n in h.table.index]
        pats = None
        if patterns is not None:
            pats = [q for q in patterns if any(fnmatch.fnmatchcase(n, q) for n in h.table.names)]
        everything = names is None and patterns is None and predicate is None and layers is None
        if everything:
            out.append(select_file(h, p, None, None, None, None))
        else:
            out.append(select_file(h, p, mine or [], pats or [], predicate, layers))
    return out


def select_file(header: Header, path: str, names, patterns, predicate, layers) -> list[int]:
    """The rows of one file a selection names (:func:`engine.planning.plan.select_rows`),
    its errors naming ``path``."""
    try:
        return select_rows(header.table, names, patterns=patterns, predicate=predicate, layers=layers)
    except SafetensorError as err:
        err.path = path
        raise
