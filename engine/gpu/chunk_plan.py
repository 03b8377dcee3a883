"""A device load's plan for the chunk ring: its pieces (file, offset, bytes, device address) cut
into chunks once (:func:`plan`, natively: :mod:`engine.gpu._chunk_plan`: one
``chunk_bytes``-aligned block of a file per chunk), and what follows the chunks back to the
tensors: which chunk each tensor lands with (:class:`Landing`) and the checksum cells of each
piece's share of a chunk (:class:`Digests`)."""

from __future__ import annotations

import numpy as np

from engine.format.checksums import combine

__all__ = ["Digests", "Landing", "Pieces", "plan"]


class Pieces:
    """The load's pieces in load order, as the native planner takes them, and for each
    tensor key its bytes and the index of its last piece."""

    def __init__(self, sources, targets, address) -> None:
        files, offs, lens, dsts, toffs = [], [], [], [], []
        self.keys: list = []  # per piece
        self.sizes: dict = {}
        self.empty: list = []
        for i, src in enumerate(sources):
            base = src.row_base
            for req in src.requests:
                for p in req.pieces:
                    key = base + p.row
                    if not p.nbytes:
                        self.sizes.setdefault(key, 0)
                        continue
                    files.append(i)
                    offs.append(req.offset + p.request_offset)
                    lens.append(p.nbytes)
                    dsts.append(address(targets[key]) + p.tensor_offset)
                    toffs.append(p.tensor_offset)
                    self.keys.append(key)
                    self.sizes[key] = self.sizes.get(key, 0) + p.nbytes
        self.file = np.array(files, np.int32)
        self.off = np.array(offs, np.int64)
        self.len = np.array(lens, np.int64)
        self.dst = np.array(dsts, np.uint64)
        self.toff = toffs  # per piece: its offset in its tensor


class Digests:
    """The checksum cells of a ring load (see ``engine.gpu._ring.ChunkRing.run``): the copy
    threads fill them; :meth:`give` joins each checked tensor's cells, in its byte order,
    into the tracker just before the tensor is reported."""

    def __init__(self, pieces: Pieces, nfiles: int, chunk_bytes: int, tracker) -> None:
        self.tracker = tracker
        order = np.lexsort((pieces.off, pieces.file)) if len(pieces.len) else np.empty(0, np.intp)
        self.d_off = np.ascontiguousarray(pieces.off[order])
        self.d_len = np.ascontiguousarray(pieces.len[order])
        self.d_first = np.searchsorted(pieces.file[order], np.arange(nfiles + 1), side="left").astype(np.int64)
        first = self.d_off // chunk_bytes
        ncell = (self.d_off + self.d_len - 1) // chunk_bytes - first + 1
        self.d_cell = (np.cumsum(ncell) - ncell).astype(np.int64)
        self.cells = np.zeros(max(int(ncell.sum()), 1), np.uint32)
        self.chunk_bytes = chunk_bytes
        # key -> its pieces as (offset in the tensor, index into the sorted arrays)
        self.of: dict = {}
        for i, p in enumerate(order.tolist()):
            key = pieces.keys[p]
            if key in tracker.checked:
                self.of.setdefault(key, []).append((pieces.toff[p], i))

    def arrays(self) -> dict:
        return {"d_off": self.d_off, "d_len": self.d_len, "d_first": self.d_first, "d_cell": self.d_cell,
                "cells": self.cells}

    def give(self, keys) -> None:
        cb = self.chunk_bytes
        for key in keys:
            segs = self.of.pop(key, None)
            if segs is None:
                continue
            crc = 0
            for _, i in sorted(segs):
                off, n, cell = int(self.d_off[i]), int(self.d_len[i]), int(self.d_cell[i])
                end = off + n
                while off < end:
                    nxt = min(end, (off // cb + 1) * cb)
                    crc = combine(crc, int(self.cells[cell]), nxt - off)
                    cell += 1
                    off = nxt
            self.tracker.add_segment(key, 0, self.tracker.remaining[key], crc)


def plan(pieces: Pieces, chunk_bytes: int):
    """The chunk plan of :func:`engine.gpu._chunk_plan.plan`, trimmed: ``(c_file, c_seg, s_pos, s_off,
    s_len, s_dst)``."""
    from engine.gpu import _chunk_plan

    n = len(pieces.len)
    total = int(pieces.len.sum()) if n else 0
    cap = n + 2 * (total // chunk_bytes) + 2
    c_file = np.empty(cap, np.int32)
    c_seg = np.empty(cap + 1, np.int64)
    s_pos, s_off, s_len = (np.empty(cap + n, np.int64) for _ in range(3))
    s_dst = np.empty(cap + n, np.uint64)
    k, m = _chunk_plan.plan(pieces.file, pieces.off, pieces.len, pieces.dst, chunk_bytes, c_file, c_seg, s_pos, s_off,
                      s_len, s_dst)
    return c_file[:k].copy(), c_seg[: k + 1].copy(), s_pos[:m].copy(), s_off[:m].copy(), s_len[:m].copy(), \
        s_dst[:m].copy()


class Landing:
    """Reports each tensor to the tracker once the chunk holding its last byte has completed."""

    def __init__(self, pieces: Pieces, c_seg, s_len, tracker, digests: Digests | None = None) -> None:
        self.tracker = tracker
        self.digests = digests
        self.sizes = pieces.sizes
        self.reported = 0
        self.seconds = 0.0  # spent reporting (and in what the tracker's callbacks do)
        if len(pieces.sizes) == 1 and len(pieces.len):
            # one tensor (get_tensor's load): it lands with the load's last chunk
            self.order = list(pieces.sizes)
            self.chunk = np.array([len(c_seg) - 2], np.int64)
            return
        if len(pieces.len):
            seg_end = np.cumsum(s_len)
            chunk_end = seg_end[c_seg[1:] - 1]
            piece_chunk = np.searchsorted(chunk_end, np.cumsum(pieces.len), side="left")
        else:
            piece_chunk = np.empty(0, np.int64)
        last: dict = {}
        for key, c in zip(pieces.keys, piece_chunk.tolist(), strict=True):
            last[key] = c
        order = sorted(last.items(), key=lambda kv: kv[1])
        self.order = [k for k, _ in order]
        self.chunk = np.array([c for _, c in order], np.int64)
        tracker.landed([(k, 0) for k, n in pieces.sizes.items() if n == 0])

    def upto(self, done: int) -> None:
        """Chunks ``[0, done)`` have completed."""
        if self.reported == len(self.order):
            return
        stop = int(np.searchsorted(self.chunk, done, side="left"))
        if stop > self.reported:
            keys = self.order[self.reported : stop]
            self.reported = stop
            if self.digests is not None:
                self.digests.give(keys)
            self.tracker.landed([(k, self.sizes[k]) for k in keys])
