"""The copy path's staging slots: :class:`Ring` (the slots of one device load, the first
allocated on first use, the others page-locked ahead on helper threads) and
:class:`KeptStaging` (slots kept between loads when :func:`keep_staging` asks).  Used by
:mod:`engine.gpu.device_load`."""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["Ring", "KeptStaging", "KEPT_STAGING", "keep_staging"]


class KeptStaging:
    """Staging slots kept between device loads, when asked for (:func:`keep_staging`, or
    ``ENGINE_KEEP_STAGING=1``): page-locking a slot costs a fault and a lock per page, paid
    again by every load otherwise (small with the default slots of a few MiB per core, tens
    of milliseconds for slots of hundreds of MiB).  Only for device operations that name their
    slots' kind (``ops.staging_key``, e.g. the torch sink's ``("torch", "cuda:0")``).  A load
    takes any kept slot at least as large as it needs (the smallest such), so loads of other
    sizes share them; at most :data:`MAX_KEPT` slots per kind are kept, the smallest freed
    first.  Off by default: then nothing stays page-locked after a load."""

    #: slots kept per kind of device operations
    MAX_KEPT = 4

    def __init__(self) -> None:
        self.on = os.environ.get("ENGINE_KEEP_STAGING", "") == "1"
        self.lock = threading.Lock()
        self.kept: dict[Any, list] = {}  # staging_key -> [(bytes, ops, slot), ...], smallest first

    def take(self, ops, nbytes: int):
        key = getattr(ops, "staging_key", None)
        if not self.on or key is None:
            return None
        with self.lock:
            kept = self.kept.get(key, [])
            for i, (size, _, slot) in enumerate(kept):
                if size >= nbytes:
                    del kept[i]
                    return slot
        return None

    def give(self, ops, slot) -> bool:
        """Keep ``slot`` (``(handle, view)``) for a later load; False when it is not kept
        (the caller frees it)."""
        key = getattr(ops, "staging_key", None)
        if not self.on or key is None:
            return False
        with self.lock:
            kept = self.kept.setdefault(key, [])
            kept.append((len(slot[1]), ops, slot))
            kept.sort(key=lambda k: k[0])
            extra = kept[: max(0, len(kept) - self.MAX_KEPT)]
            del kept[: len(extra)]
        _free_slots([(o, sl) for _, o, sl in extra])
        return True

    def release(self) -> None:
        with self.lock:
            entries, self.kept = list(self.kept.values()), {}
        for kept in entries:
            _free_slots([(o, sl) for _, o, sl in kept])


def _free_slots(slots) -> None:
    for ops, slot in slots:
        free = getattr(ops, "free_staging", None)
        if free is not None:
            free(slot[0])


#: the process's kept staging slots (see :func:`keep_staging`)
KEPT_STAGING = KeptStaging()


def keep_staging(on: bool = True) -> None:
    """Keep the copy path's page-locked staging slots between device loads (``True``), or
    free the kept ones and stop keeping them (``False``).  A server that loads several models
    or reloads one saves the page-locking of every slot on every load after the first; the
    cost is up to ``slots * slot_bytes`` of host memory locked until
    ``keep_staging(False)``.  Same as ``ENGINE_KEEP_STAGING=1`` at start-up."""
    from engine.gpu.device_ring import keep_rings

    KEPT_STAGING.on = bool(on)
    if not on:
        KEPT_STAGING.release()
    keep_rings(on)


class Ring:
    """The copy path's staging slots.  Slot 0 is allocated on first use; the others are
    allocated at once on helper threads (page-locking large slots takes tens of
    milliseconds), so they are ready when the first slot's copies are issued."""

    def __init__(self, ops, slots: int, nbytes: int, ahead: bool) -> None:
        self.ops = ops
        self.nbytes = nbytes
        self.slots: list = [None] * slots
        self.errors: list = [None] * slots
        self.helpers: list[threading.Thread | None] = [None] * slots
        if ahead:
            for s in range(1, slots):
                t = threading.Thread(target=self._allocate, args=(s,), name="engine-staging", daemon=True)
                t.start()
                self.helpers[s] = t

    def _allocate(self, s: int) -> None:
        try:
            self.ops.bind_thread()
            self.slots[s] = KEPT_STAGING.take(self.ops, self.nbytes) or self.ops.alloc_staging(self.nbytes)
        except BaseException as exc:  # re-raised when the slot is asked for
            self.errors[s] = exc

    def slot(self, s: int):
        helper = self.helpers[s]
        if helper is not None:
            helper.join()
            self.helpers[s] = None
            if self.errors[s] is not None:
                raise self.errors[s]
        if self.slots[s] is None:
            self.slots[s] = KEPT_STAGING.take(self.ops, self.nbytes) or self.ops.alloc_staging(self.nbytes)
        return self.slots[s]

    def free(self) -> None:
        for helper in self.helpers:
            if helper is not None:
                helper.join()
        free = getattr(self.ops, "free_staging", None)
        for slot in self.slots:
            if slot is not None and not KEPT_STAGING.give(self.ops, slot) and free is not None:
                free(slot[0])
        self.slots = [None] * len(self.slots)
