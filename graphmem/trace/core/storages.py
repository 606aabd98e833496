"""The recorder's storage books: every storage the step touches, its size, roles, creation and release.

Input: tensors as the recorder sees them (op inputs and outputs, tensors the step drivers
mark), and the number of ops recorded so far.  Output: ``StorageRecord``s (graphmem.records)
with the op after which each storage was created and released.

A sparse tensor has no storage of its own: its memory is its parts' (COO's indices and values,
CSR's compressed indices, plain indices and values: graphmem.trace.values.sparse), each a
storage of the books, watched through the sparse tensor.

Releases are observed, not guessed: each tensor seen carries a weak reference whose callback
flags its storage, and only flagged storages are checked at a poll, so recording costs time
linear in the number of ops however many storages are live.  The books hold weak references
only; they never keep a tensor alive.  (``GRAPHMEM_CHECK_EVERY_STORAGE=1`` checks every live
storage at every poll instead; the tests compare the two.)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import StorageWeakRef, expr_of, hint_of, local_tensor, storage_expired, storage_key
from graphmem.job.option import spelling
from graphmem.records import OpRecord, Role, StorageRecord
from graphmem.trace.values.sparse import is_sparse, parts

__all__ = ["HELD", "LiveStorage", "StorageBooks"]

# roles whose tensors graphmem holds for the whole recording (none in a program, graphmem run)
HELD = frozenset({Role.PARAMETER, Role.BUFFER, Role.INPUT})


class LiveStorage:
    """Mutable bookkeeping for one storage while recording; frozen into StorageRecord.

    Where sizes are symbols (graphmem.trace.symbolic), ``nbytes`` and ``shape`` are their
    values while recording and ``sizes`` holds (bytes, shape) as expressions of the symbols."""

    __slots__ = ("sid", "cdata", "ref", "nbytes", "created", "released", "roles", "label", "shape", "dtype",
                 "sizes")

    def __init__(self, sid: int, ref: StorageWeakRef, nbytes: Any, created: int,
                 t: torch.Tensor) -> None:
        self.sid, self.ref, self.created = sid, ref, created
        self.cdata = ref.cdata  # the weak reference's handle: the key of the live tables
        self.released: int | None = None
        self.roles: set[Role] = set()
        self.label = ""
        self.dtype = str(t.dtype).removeprefix("torch.")
        shape = tuple(t.shape)
        self.sizes: tuple[Any, tuple[Any, ...]] | None = None
        if isinstance(nbytes, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in shape):
            self.sizes = (expr_of(nbytes), tuple(expr_of(d) for d in shape))
            nbytes, shape = hint_of(nbytes), tuple(hint_of(d) for d in shape)
        self.nbytes, self.shape = nbytes, shape


class StorageBooks:
    """The storages of one recording, in order of first sight; ``ops`` is the recorder's op
    list (its length is the clock: a storage made now was created by the op being recorded)."""

    def __init__(self, ops: Sequence[OpRecord], held: frozenset[Role] = HELD) -> None:
        self.ops = ops
        self.storages: list[LiveStorage] = []
        self.held = held
        self.owner: dict[int, str] = {}  # sid -> parameter name, for gradients and optimizer state
        self._live: dict[int, LiveStorage] = {}  # storage cdata -> record, for unreleased storages
        self._polled: set[int] = set()  # the unreleased storages that may be released
        # id(tensor) -> the ref that flags its storages when it dies, and those storages
        self._watched: dict[int, tuple[weakref.ref[torch.Tensor], list[int]]] = {}
        self._dropped: list[int] = []  # storages one of whose tensors died since the last poll
        self._check_all = os.environ.get("GRAPHMEM_CHECK_EVERY_STORAGE") == "1"
        self._replaced: list[tuple[torch.Tensor, LiveStorage, int]] = []  # buffers assigned over: (old, record, at)
        # graphmem run on a GPU: the storages on the GPU (the rest are the host's, 0 bytes of the
        # GPU's; see place); None: every storage is the device's
        self.on_gpu: set[int] | None = None
        self.mapped: set[int] = set()  # storages mapped from a file (a loaded checkpoint): 0 allocated bytes
        self._emptied: dict[int, LiveStorage] = {}  # storage cdata -> its record when it was resized to 0

    def track(self, t: torch.Tensor, created: int) -> LiveStorage:
        """The record of ``t``'s storage, created now if unseen (a DTensor's: its local tensor's;
        a sparse tensor's: its first part's, every part tracked: ``track_all``)."""
        t = local_tensor(t)
        if t.layout is not torch.strided and is_sparse(t):
            return self.track_all(t, created)[0]
        return self._track(t, t, created)

    def track_all(self, t: torch.Tensor, created: int) -> list[LiveStorage]:
        """The records of all of ``t``'s storages: its own, or a sparse tensor's parts', each
        flagged for a poll when ``t`` dies."""
        t = local_tensor(t)
        if t.layout is torch.strided or not is_sparse(t):
            return [self._track(t, t, created)]
        return [self._track(part, t, created) for part in parts(t)]

    def _track(self, t: torch.Tensor, holder: torch.Tensor, created: int) -> LiveStorage:
        """The record of ``t``'s storage, watched through ``holder`` (``t`` itself, or the sparse
        tensor ``t`` is a part of)."""
        cdata, ref, nbytes = storage_key(t)
        rec = self._live.get(cdata)
        if rec is None or storage_expired(cdata):
            rec = LiveStorage(len(self.storages), ref, nbytes, created, t)
            self.storages.append(rec)
            self._live[cdata] = rec
            self._polled.add(cdata)
        self._watch(holder, cdata)
        return rec

    def _watch(self, t: torch.Tensor, cdata: int) -> None:
        """Flag ``cdata`` for the next poll when ``t`` dies (its storage may die with it).  A
        tensor given another storage in place (``set_``: torch.load rebuilds every tensor so)
        flags each of its storages when it dies, and its earlier ones at the next poll (the
        one it let go of may have died now)."""
        key = id(t)
        entry = self._watched.get(key)
        if entry is not None and entry[0]() is t:
            if cdata not in entry[1]:
                self._dropped.extend(entry[1])
                entry[1].append(cdata)
            return
        dropped, watched = self._dropped, self._watched
        storages = [cdata]

        def died(dead: weakref.ref[torch.Tensor]) -> None:
            dropped.extend(storages)
            now = watched.get(key)
            if now is not None and now[0] is dead:
                del watched[key]

        self._watched[key] = (weakref.ref(t, died), storages)

    def unwatch(self, t: torch.Tensor) -> bool:
        """Drop the weak reference on ``t`` itself (``torch.utils.swap_tensors`` refuses a tensor
        that has one); True when there was one: ``track`` it again to watch it."""
        entry = self._watched.get(id(t))
        if entry is None or entry[0]() is not t:
            return False
        del self._watched[id(t)]
        self._dropped.extend(entry[1])
        return True

    def mark(self, t: torch.Tensor, role: Role, label: str = "", owner: str = "") -> None:
        """Give ``t``'s storage a role (parameter, gradient, saved, ...), a name, and the
        parameter it belongs to (for gradients and optimizer state)."""
        for rec in self.track_all(t, created=len(self.ops) - 1 if self.ops else -1):
            rec.roles.add(role)
            if role in self.held and rec.released is None:  # held by graphmem itself: never released
                self._polled.discard(rec.cdata)
            if label and not rec.label:
                rec.label = label
            if owner:
                self.owner.setdefault(rec.sid, owner)

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (FSDP2 frees and regrows unsharded parameters
        so): its old size was live until the last op, the new one is live from the next.  Grown
        again after it was emptied, it is the same storage: its roles, name and place (on the GPU
        or not) are the ones it had before."""
        cdata, ref, nbytes = storage_key(local_tensor(t))
        rec = self._live.get(cdata)
        if rec is not None and (rec.sizes[0] if rec.sizes else rec.nbytes) == expr_of(nbytes):
            return
        now = len(self.ops)
        if rec is not None:
            if rec.created == now:  # grown and freed between the same two ops: never live
                rec.nbytes = 0
            rec.released = max(now - 1, rec.created)
            del self._live[cdata]
            self._polled.discard(cdata)
        emptied = self._emptied.pop(cdata, None)
        before = emptied if emptied is not None and not emptied.ref.expired() else rec
        if not hint_of(nbytes):
            if before is not None:
                self._emptied[cdata] = before
            return
        new = LiveStorage(len(self.storages), ref, nbytes, now, t)
        new.roles = {*(before.roles if before is not None else ()), Role.COMMUNICATION}
        new.label = before.label if before is not None else ""
        if self.on_gpu is not None and before is not None and before.sid in self.on_gpu:
            self.on_gpu.add(new.sid)
        self.storages.append(new)
        self._live[cdata] = new
        self._polled.add(cdata)

    def place(self, device: Any, in_sids: tuple[int, ...], out_sids: tuple[int, ...], host_asked: bool) -> bool:
        """Where the storages an op made live, with ``on_gpu``: on the GPU when the op was asked
        for the GPU (``device="cuda"``, a copy to it), or read a tensor on the GPU; on the host
        when the program's Python code asked for the CPU (``host_asked``: ``device="cpu"``,
        ``.cpu()``, a tensor made from nothing with no device given: torch's default device), or
        when it read only host tensors.  A CPU device that torch's C++ code gives
        (a tensor's options: DDP's buckets from its parameters) is the fakes' device, the GPU's
        stand-in: it decides nothing.  An op made of nothing and asked for nothing is on the GPU
        only when C++ asked for it (an explicit device); torch.zeros(n) alone is the host's.
        An output that is an input's storage keeps its place.  Returns whether the op ran on
        the GPU."""
        assert self.on_gpu is not None, \
            f"StorageBooks.place: only where storages are placed (graphmem run {spelling('gpu')})"
        on_gpu = self.on_gpu
        kind = torch.device(device).type if isinstance(device, (torch.device, str)) else None
        if kind == "cuda":
            here = True
        elif host_asked and (kind == "cpu" or not in_sids):
            here = False
        else:
            here = any(sid in on_gpu for sid in in_sids) or (kind == "cpu" and not in_sids)
        if here:
            now = len(self.ops)
            on_gpu.update(sid for sid in out_sids if sid not in in_sids and self.storages[sid].created == now)
        return here or any(sid in on_gpu for sid in out_sids)

    def _cdata_of(self, t: torch.Tensor) -> int:
        """The key of ``t``'s storage in the live tables; a sparse tensor's: its first part's, as
        tracked (no op asks for its parts here: a fake's ops read its ``device``, which asks
        ``is_on_gpu`` on a GPU target); 0 (no storage's) for one never tracked."""
        t = local_tensor(t)
        if t.layout is torch.strided or not is_sparse(t):
            return storage_key(t)[0]
        entry = self._watched.get(id(t))
        return entry[1][0] if entry is not None and entry[0]() is t else 0

    def sid_of(self, t: torch.Tensor) -> int | None:
        """The storage id of live ``t``'s storage (a DTensor's: its local tensor's), None when
        the books never saw it."""
        rec = self._live.get(self._cdata_of(t))
        return None if rec is None else rec.sid

    def is_on_gpu(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is on the GPU (with ``on_gpu``; else every tensor is)."""
        if self.on_gpu is None:
            return True
        rec = self._live.get(self._cdata_of(t))
        return rec is not None and rec.sid in self.on_gpu

    def hold(self, t: torch.Tensor) -> None:
        """A tensor made outside the recording (real) that the program holds from now on: live
        from the last op until it dies."""
        self.track(t, len(self.ops) - 1)

    def map_from_file(self, t: torch.Tensor) -> None:
        """``t``'s storage is mapped from a file (its bytes are the file's, not allocated)."""
        if t.device.type == "cpu" and not (self.on_gpu is not None and self.is_on_gpu(t)):
            self.mapped.add(self.track(t, len(self.ops) - 1).sid)

    def buffer_replaced(self, old: torch.Tensor, new: Any) -> None:
        """The model assigned ``new`` over its buffer ``old`` (``self.x_min = self.x_min + x``):
        a real run frees ``old`` then, unless something else holds it (``release_replaced``)."""
        cdata = self._cdata_of(old)
        if isinstance(new, torch.Tensor) and self._cdata_of(new) == cdata:
            return  # the same storage (an in-place update, a view of it)
        rec = self._live.get(cdata)
        if rec is not None and Role.BUFFER in rec.roles and rec.released is None:
            self._replaced.append((old, rec, len(self.ops) - 1))

    def release_replaced(self, model: nn.Module) -> None:
        """Release the buffers the model assigned over and none of its modules holds any more:
        after their last use, or when replaced.  (Most models replace none: nothing to do.)"""
        if not self._replaced:
            return
        held = {id(b) for b in model.buffers()}
        dropped = {rec.sid: (rec, at) for old, rec, at in self._replaced if id(old) not in held}
        last: dict[int, int] = {}
        for op in self.ops:
            for sid in op.inputs:
                if sid in dropped:
                    last[sid] = op.index
        for sid, (rec, at) in dropped.items():
            rec.released = max(at, last.get(sid, at))
            self._live.pop(rec.cdata, None)

    def poll(self, everything: bool = False) -> None:
        """Note every storage released since the last op: it was live until that op.

        Checked: the storages one of whose tensors died since the last poll (``everything``:
        all unreleased ones).  Parameters, buffers and inputs are not polled: graphmem holds
        them for the whole step.  The check is the C call behind StorageWeakRef.expired, on
        each weak reference's handle (valid while the record holds its StorageWeakRef)."""
        last = len(self.ops) - 1
        if everything or self._check_all:
            candidates: Any = list(self._polled)
            self._dropped.clear()
        else:
            candidates, self._dropped[:] = list(self._dropped), []
        for cdata in candidates:
            if cdata in self._polled and storage_expired(cdata):
                self._polled.discard(cdata)
                self._live.pop(cdata).released = last

    def freeze(self) -> tuple[StorageRecord, ...]:
        """The storage records, final; call after the last poll."""
        return tuple(
            StorageRecord(sid=s.sid, nbytes=s.nbytes if (self.on_gpu is None or s.sid in self.on_gpu)
                          and s.sid not in self.mapped else 0,
                          created=s.created, released=s.released,
                          roles=frozenset(s.roles), label=s.label, shape=s.shape, dtype=s.dtype)
            for s in self.storages)
