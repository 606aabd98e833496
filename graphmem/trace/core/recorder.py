"""The dispatch-level recorder behind stage 2 (trace).

A TorchDispatchMode that sits above FakeTensorMode and sees every aten op the step
dispatches, in execution order: forward, the autograd engine's backward, the optimizer.
For each op it appends an fx node and an ``OpRecord``; for each storage it keeps a weak
reference and notes the op after which the storage was released.  Releases come from the
same reference counting that frees memory in a real run (Python references, autograd's
saved tensors, the optimizer's state), so they are observed, not guessed.

Only the recorder holds weak references; it never keeps a tensor alive.  A storage can only
be released when a tensor that uses it dies, so each tensor the recorder sees carries a weak
reference whose callback flags its storage, and only flagged storages are checked after an op:
recording costs time linear in the number of ops, however many storages are live.
(``GRAPHMEM_CHECK_EVERY_STORAGE=1`` checks every live storage after every op instead; the
tests compare the two.)
"""

from __future__ import annotations

import bisect
import contextlib
import linecache
import math
import operator
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from graphmem import interrupts, progress
from graphmem._torch_api import (
    DATA_DEPENDENT_ERRORS,
    DynamicOutputShapeException,
    StorageWeakRef,
    TorchDispatchMode,
    autograd_sequence_nr,
    count_flops,
    current_autograd_node,
    expr_of,
    hint_of,
    local_tensor,
    storage_expired,
    storage_key,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)
from graphmem.errors import TraceError, UserInputError
from graphmem.records import OpRecord, Phase, Role, StorageRecord
from graphmem.trace.rules.registry import ArgMeta, Rule, RuleTable, output_bounds, output_shapes, scratch_bytes
from graphmem.trace.values.counts import NonzeroCounts
from graphmem.trace.values.shadows import Shadows

__all__ = ["Recorder", "fixed_outputs"]

_READ = torch.ops.aten._local_scalar_dense.default
_REPEAT = torch.ops.aten.repeat_interleave.Tensor  # no bound: as long as the sum of its repeats
_HELD = frozenset({Role.PARAMETER, Role.BUFFER, Role.INPUT})
# FakeTensorMode turns a real constant (torch.tensor(1.0)) into a fake copy through these; in a
# real run input and output are one tensor, so only the output is counted.
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)
_FAKES_ON = torch.device("cpu")
# size queries that reach the mode when sizes are symbols (graphmem.trace.symbolic): no
# tensor, no memory, and not dispatched at all when sizes are numbers, so never recorded
_SIZE_QUERIES = frozenset(getattr(packet, overload) for packet in (
    torch.ops.aten.size, torch.ops.aten.stride, torch.ops.aten.numel, torch.ops.aten.storage_offset,
    torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel, torch.ops.aten.sym_storage_offset)
    for overload in packet.overloads())
_PROGRESS_EVERY = 4096  # recorded ops between progress lines
# what a value-dependent op is called in a note
_BOUNDED_NAMES = {"index": "boolean-mask indexing", "_unique2": "unique", "unique_dim": "unique"}
# bitsandbytes' LLM.int8 ops whose outlier columns are bounded (graphmem.trace.rules.quantized)
_INT8_OUTLIER_OPS = frozenset({"int8_vectorwise_quant", "int8_double_quant", "int8_mixed_scaled_mm"})
_INT8_OUTLIERS = ("LLM.int8 computes the input columns holding a value past its threshold (6.0) in 16 bits, "
                  "and how many there are depends on values; ")
# ops of torch.distributed's collectives and FSDP2's copies in and out of their buffers
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "fsdp"})
# ops whose real kernel returns its input tensor itself, where the fake kernel makes a new one
# (functional collectives' wait: c10d/Functional.cpp wait_tensor returns ``self``)
_RETURNS_INPUT = frozenset(op for op in (getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None),)
                           if op is not None)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ArgMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
    return value


def _metas(args: Any, kwargs: Any, known: Mapping[int, torch.Tensor] | None = None) -> tuple[Any, Any]:
    """An op's arguments as a rule sees them: tensors as ``ArgMeta``, except those in
    ``known`` (by id), which are given as the real tensors holding their values."""
    def one(value: Any) -> Any:
        if known and isinstance(value, torch.Tensor) and id(value) in known:
            return known[id(value)]
        return _to_meta(value)
    return tree_map(one, tuple(args)), tree_map(one, dict(kwargs))


def fixed_outputs(rules: RuleTable, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``out`` with the op's output_dtypes and output_shapes rules applied: outputs re-created
    in the real kernel's dtype, then with the real kernel's size."""
    dtype_rule, shape_rule = rules.output_dtypes.get(func), rules.output_shapes.get(func)
    if (dtype_rule is None and shape_rule is None) or not isinstance(out, tuple):
        return out
    meta_args, meta_kwargs = _metas(args, kwargs)
    if dtype_rule is not None:
        fixes = dtype_rule(meta_args, meta_kwargs)
        out = tuple(torch.empty_like(t, dtype=fixes[i]) if i in fixes else t for i, t in enumerate(out))
    if shape_rule is not None:
        shapes = output_shapes(shape_rule, meta_args, meta_kwargs)
        out = tuple(t.new_empty(shapes[i]) if i in shapes else t for i, t in enumerate(out))
    return out


def _fresh_outputs(func: Any, out: Any) -> Any:
    """Give each non-aliasing output of ``func`` its own storage.

    A return without an alias annotation in the op's schema is a fresh tensor on every real
    backend, but a few meta kernels return one tensor twice (mkldnn_rnn_layer_backward gives
    the same bias gradient for bias_ih and bias_hh).  That shared storage would make
    AccumulateGrad copy a gradient the real run steals, so the duplicate is replaced.
    """
    if not isinstance(out, tuple) or len(out) < 2:
        return out
    returns = func._schema.returns
    seen: set[int] = set()
    fixed = list(out)
    for i, item in enumerate(out):
        if not isinstance(item, torch.Tensor) or i >= len(returns) or returns[i].alias_info is not None:
            continue
        if id(item) in seen:
            fixed[i] = torch.empty_like(item)
        seen.add(id(item))
    return tuple(fixed)


_DTYPE_WORDS = ("dtype", "scalar type")


def _real_dtype_error(func: Any, args: Any, kwargs: Any) -> str:
    """The real CPU kernel's dtype complaint about ``func`` on one-element tensors of the same
    dtypes and ranks as ``args`` ("" when it has none: it runs, or fails for another reason)."""
    def tiny(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros([1] * value.dim(), dtype=value.dtype)
        return value
    with unset_fake_temporarily():
        try:
            real_args, real_kwargs = tree_map(tiny, (tuple(args), dict(kwargs)))
            func(*real_args, **real_kwargs)
        except (RuntimeError, TypeError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return text if any(word in text for word in _DTYPE_WORDS) else ""
    return ""


class _Storage:
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


class Recorder(TorchDispatchMode):
    """Records ops and storage lifetimes; see the module docstring."""

    def __init__(self, rules: RuleTable) -> None:
        super().__init__()
        self.graph = torch.fx.Graph()
        self.ops: list[OpRecord] = []
        self.storages: list[_Storage] = []
        self.phase, self.iteration = Phase.FORWARD, 0
        self.module_stack: list[str] = []
        self._rules = rules
        self._live: dict[int, _Storage] = {}  # storage cdata -> record, for unreleased storages
        self._polled: set[int] = set()  # the unreleased storages that may be released
        self._watched: dict[int, weakref.ref[torch.Tensor]] = {}  # id(tensor) -> ref that flags its storage
        self._dropped: list[int] = []  # storages one of whose tensors died since the last poll
        self._check_all = os.environ.get("GRAPHMEM_CHECK_EVERY_STORAGE") == "1"
        self._nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> fx node
        self._seq_starts: list[int] = []  # autograd sequence nr -> module, for backward ops
        self._seq_modules: list[str] = []
        self._owner: dict[int, str] = {}  # sid -> parameter name, for optimizer/grad ops
        self._constants = 0
        self.pending: tuple[str, str] = ("", "")
        self.assumptions: list[str] = []
        self.scalar_reads: list[Any] = []  # values the optimizer step reads, from graphmem.trace.step.replica
        self._read_index = 0
        self._silent = False
        self.shadows = Shadows()
        self.counts = NonzeroCounts()  # masks built from zeros by setting k elements
        self._dtype_checked: dict[Any, str] = {}
        self.kept: float | None = None  # --assume nonzero=F: value-dependent sizes at F of their most
        self.read_value: int | None = None  # --assume reads=N: a read of unknown values gives N
        self.held = _HELD  # roles whose tensors graphmem holds for the whole recording (none in a program)
        self.read_note = ""  # how the notes say where read_value came from, when not from --assume reads=N
        self.declared: dict[str, set[str]] = {}  # where it answered (the model's line) -> modules
        # sizes as symbols (graphmem.trace.symbolic): op index -> (scratch bytes, flops) as
        # expressions, for the ops where either is one
        self.op_sizes: dict[int, tuple[Any, Any]] = {}
        self.bounded = False  # a value-dependent op was recorded at its bound
        self._replaced: list[tuple[torch.Tensor, _Storage, int]] = []  # buffers assigned over: (old, record, at)
        # graphmem run on a GPU: the storages on the GPU (the rest are the host's, 0 bytes of the
        # GPU's; see place); None: every storage is the device's
        self.on_gpu: set[int] | None = None
        self.dispatching = 0  # > 0 while an op runs (torch's kernels, not the program's code)
        self.host_asked = 0  # > 0 while the program's own Python code asks for the CPU (device="cpu", .cpu())
        self.where: Callable[[], str] | None = None  # graphmem run: the program's line running now
        self.mapped: set[int] = set()  # storages mapped from a file (a loaded checkpoint): 0 allocated bytes

    # -- storages ---------------------------------------------------------------------
    def track(self, t: torch.Tensor, created: int) -> _Storage:
        """The record of ``t``'s storage, created now if unseen (a DTensor's: its local tensor's)."""
        t = local_tensor(t)
        cdata, ref, nbytes = storage_key(t)
        rec = self._live.get(cdata)
        if rec is None or storage_expired(cdata):
            rec = _Storage(len(self.storages), ref, nbytes, created, t)
            self.storages.append(rec)
            self._live[cdata] = rec
            self._polled.add(cdata)
        self._watch(t, cdata)
        return rec

    def _watch(self, t: torch.Tensor, cdata: int) -> None:
        """Flag ``cdata`` for the next poll when ``t`` dies (its storage may die with it)."""
        key = id(t)
        ref = self._watched.get(key)
        if ref is not None and ref() is t:
            return
        dropped, watched = self._dropped, self._watched

        def died(dead: weakref.ref[torch.Tensor]) -> None:
            dropped.append(cdata)
            if watched.get(key) is dead:
                del watched[key]

        self._watched[key] = weakref.ref(t, died)

    def mark(self, t: torch.Tensor, role: Role, label: str = "", owner: str = "") -> None:
        """Give ``t``'s storage a role (parameter, gradient, saved, ...), a name, and the
        parameter it belongs to (for gradients and optimizer state)."""
        rec = self.track(t, created=len(self.ops) - 1 if self.ops else -1)
        rec.roles.add(role)
        if role in self.held and rec.released is None:  # held by graphmem itself: never released
            self._polled.discard(rec.cdata)
        if label and not rec.label:
            rec.label = label
        if owner:
            self._owner.setdefault(rec.sid, owner)

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (FSDP2 frees and regrows unsharded parameters
        so): its old size was live until the last op, the new one is live from the next."""
        cdata, ref, nbytes = storage_key(local_tensor(t))
        rec = self._live.get(cdata)
        if rec is not None and (rec.sizes[0] if rec.sizes else rec.nbytes) == expr_of(nbytes):
            return
        if rec is not None:
            if rec.created == len(self.ops):  # grown and freed between the same two ops: never live
                rec.nbytes = 0
            rec.released = max(len(self.ops) - 1, rec.created)
            del self._live[cdata]
            self._polled.discard(cdata)
        if hint_of(nbytes):
            new = _Storage(len(self.storages), ref, nbytes, len(self.ops), t)
            new.roles = {*(rec.roles if rec is not None else ()), Role.COMMUNICATION}
            new.label = rec.label if rec is not None else ""
            self.storages.append(new)
            self._live[cdata] = new
            self._polled.add(cdata)

    def place(self, device: Any, in_sids: tuple[int, ...], out_sids: tuple[int, ...]) -> bool:
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
        assert self.on_gpu is not None
        on_gpu = self.on_gpu
        kind = torch.device(device).type if isinstance(device, (torch.device, str)) else None
        if kind == "cuda":
            here = True
        elif self.host_asked and (kind == "cpu" or not in_sids):
            here = False
        else:
            here = any(sid in on_gpu for sid in in_sids) or (kind == "cpu" and not in_sids)
        if here:
            on_gpu.update(sid for sid in out_sids if sid not in in_sids and self.storages[sid].created == len(self.ops))
        return here or any(sid in on_gpu for sid in out_sids)

    def is_on_gpu(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is on the GPU (with ``on_gpu``; else every tensor is)."""
        if self.on_gpu is None:
            return True
        rec = self._live.get(storage_key(local_tensor(t))[0])
        return rec is not None and rec.sid in self.on_gpu

    def hold(self, t: torch.Tensor) -> None:
        """A tensor made outside the recording (real) that the program holds from now on: live
        from the last op until it dies."""
        self.track(t, len(self.ops) - 1)

    def map_from_file(self, t: torch.Tensor) -> None:
        """``t``'s storage is mapped from a file (its bytes are the file's, not allocated)."""
        if t.device.type == "cpu" and not (self.on_gpu is not None and self.is_on_gpu(t)):
            self.mapped.add(self.track(t, len(self.ops) - 1).sid)

    def add_placeholder(self, t: torch.Tensor, name: str) -> None:
        node = self.graph.placeholder(name.replace(".", "_"))
        self._nodes[t] = node

    def buffer_replaced(self, old: torch.Tensor, new: Any) -> None:
        """The model assigned ``new`` over its buffer ``old`` (``self.x_min = self.x_min + x``):
        a real run frees ``old`` then, unless something else holds it (``release_replaced``)."""
        cdata = storage_key(local_tensor(old))[0]
        if isinstance(new, torch.Tensor) and storage_key(local_tensor(new))[0] == cdata:
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

    # -- modules ----------------------------------------------------------------------
    def current_module(self, in_sids: tuple[int, ...]) -> str:
        """Module path of the op running now: the forward module stack, the autograd node
        being executed in backward, or the parameter an optimizer op works on (the owner of
        its first input storage that has one)."""
        if self.phase in (Phase.FORWARD, Phase.LOSS) or (self.module_stack and self.phase == Phase.BACKWARD):
            return self.module_stack[-1] if self.module_stack else ""
        if self.phase == Phase.BACKWARD:
            node = current_autograd_node()
            if node is not None:
                variable = getattr(node, "variable", None)  # AccumulateGrad
                if isinstance(variable, torch.Tensor):
                    return self._param_module(self.track(variable, -1).sid)
                i = bisect.bisect_left(self._seq_starts, node._sequence_nr())
                if self._seq_starts:
                    return self._seq_modules[min(i, len(self._seq_modules) - 1)]
            return ""
        for sid in in_sids:
            if sid in self._owner:
                return self._param_module(sid)
        # an optimizer temporary: it works on the same parameter as the op before it
        return self.ops[-1].module if self.ops and self.ops[-1].phase == self.phase else ""

    def _param_module(self, sid: int) -> str:
        return self._owner.get(sid, "").rpartition(".")[0]

    def _note_sequence(self, module: str) -> None:
        # Autograd numbers the op's backward node before the op reaches this mode, so the
        # newest number belongs to this op; backward ops look their node's number up here.
        newest = autograd_sequence_nr() - 1
        if not self._seq_starts or newest > self._seq_starts[-1]:
            self._seq_starts.append(newest)
            self._seq_modules.append(module)

    @contextlib.contextmanager
    def tracking_modules(self, model: nn.Module) -> Iterator[None]:
        """Keep ``module_stack`` equal to the path of the module running now (global module hooks)."""
        paths: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), name)

        def pre(module: nn.Module, args: Any) -> None:
            self.module_stack.append(paths.get(id(module), type(module).__name__))

        def post(module: nn.Module, args: Any, out: Any) -> None:
            if self.module_stack:
                self.module_stack.pop()

        handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """Ops run inside are graphmem's own bookkeeping: not recorded."""
        self._silent = True
        try:
            yield
        finally:
            self._silent = False

    # -- the mode ---------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":  # the user's device="cuda":
            kwargs = {**kwargs, "device": _FAKES_ON}  # the fakes live on the CPU (graphmem.job.devices)
        self.dispatching += 1
        try:
            return self._dispatch(func, args, kwargs, device)
        finally:
            self.dispatching -= 1

    def _dispatch(self, func: Any, args: Any, kwargs: Any, device: Any) -> Any:
        if self._silent or func.namespace in ("prim", "profiler") or func in _SIZE_QUERIES:  # queries, marks
            return func(*args, **kwargs)
        interrupts.check()  # a safe point for Ctrl-C (graphmem.interrupts): an op about to be recorded
        self.poll()
        index = len(self.ops)
        in_tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                      and func not in _LIFTS]  # a lift's input is the real constant it fakes
        in_sids = tuple(dict.fromkeys(self.track(t, index).sid for t in in_tensors))
        module = self.current_module(in_sids)
        if self.phase in (Phase.FORWARD, Phase.LOSS):
            self._note_sequence(module)
        self.pending = (str(func), module)  # named in the error if the op raises
        if self.phase in (Phase.FORWARD, Phase.LOSS) and len({t.dtype for t in in_tensors}) > 1:
            self._refuse_what_the_real_kernel_refuses(func, args, kwargs)
        scratch = self._scratch(func, args, kwargs)
        out = self._fix_dtypes(func, args, kwargs, _fresh_outputs(func, self._run(func, args, kwargs)))
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_sids = tuple(dict.fromkeys(self.track(t, index).sid for t in out_tensors))
        if self.on_gpu is not None:
            scratch = scratch if self.place(device, in_sids, out_sids) else 0
        if func.namespace in _COLLECTIVES:
            for sid in out_sids:
                self.storages[sid].roles.add(Role.COMMUNICATION)
        self._add_node(func, args, kwargs, out)
        recompute = self.phase == Phase.BACKWARD and bool(self.module_stack)
        if index % _PROGRESS_EVERY == 0 and progress.active():
            where = f", at {self.where()}" if self.where is not None else ""  # graphmem run: the program's line
            progress.show(f"recording: iteration {self.iteration + 1}, {self.phase.value}, {index:,} ops{where}")
        flops = self._flops(func, args, kwargs, out)
        if isinstance(scratch, torch.SymInt) or isinstance(flops, torch.SymInt):
            self.op_sizes[index] = (expr_of(scratch), expr_of(flops))
            scratch, flops = hint_of(scratch), hint_of(flops)
        self.ops.append(OpRecord(index=index, op=str(func), phase=self.phase,
                                 iteration=self.iteration, module=module, inputs=in_sids,
                                 outputs=out_sids, scratch_bytes=scratch, flops=flops, recompute=recompute,
                                 line=self.where() if self.where is not None else ""))
        return out

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run the op on fake tensors.  A value the optimizer step reads comes from the real
        one-element replica (graphmem.trace.step.replica), in order; a value or value-dependent shape
        the model reads comes from the assumed inputs' shadows (graphmem.trace.values.shadows)."""
        if func == _READ and self.phase == Phase.OPTIMIZER:
            return self._replica_value()
        if func.overloadpacket in _RETURNS_INPUT:
            func(*args, **kwargs)
            return args[0]
        try:
            out = func(*args, **kwargs)
        except DATA_DEPENDENT_ERRORS as exc:
            if self.shadows.answerable(args, kwargs):
                return self._from_shadows(func, args, kwargs)
            answered = self._from_values(func, args, kwargs)
            if answered is not None:
                return answered
            if func == _READ and self.read_value is not None:
                return self._declared_read(args[0])
            if func == _REPEAT and self.read_value is not None:
                return self._declared_size(args)
            rule = self._rules.output_bounds.get(func)
            if rule is None or not isinstance(exc, DynamicOutputShapeException):
                raise
            bounded = self._bounded(func, rule, args, kwargs, exc)
            self.counts.propagate(func, args, kwargs, bounded)  # nonzero of a comparison: its positions
            return bounded
        if self.phase in (Phase.FORWARD, Phase.LOSS):
            self.shadows.propagate(func, args, kwargs, out)
            self.counts.propagate(func, args, kwargs, out)
            if func == torch.ops.aten.sum.default and args[0].dtype == torch.bool and self.shadows.get(out) is None:
                most = self.counts.most(args[0])
                self.shadows.mask_count(out, hint_of(args[0].numel()) if most is None else most)
        return out

    def _declared_read(self, t: torch.Tensor) -> Any:
        """A number read from values no shadow knows, as declared with ``--assume reads=N``: N in
        the tensor's kind (a condition: true unless N is 0)."""
        n = self.read_value
        assert n is not None
        value: Any = bool(n) if t.dtype == torch.bool else float(n) if t.is_floating_point() else n
        self._note_declared(f"`{_model_line()}` read as {value}")
        return value

    def _declared_size(self, args: Any) -> torch.Tensor:
        """``repeat_interleave`` of repeats no shadow knows (its output as long as their sum), as
        declared with ``--assume reads=N``: N elements."""
        assert self.read_value is not None
        self._note_declared(f"`{_model_line()}` repeating to {self.read_value} elements")
        return torch.empty(self.read_value, dtype=args[0].dtype)

    def _note_declared(self, what: str) -> None:
        """Where a declared value answered, once per line of the model's code (modules counted)."""
        self.declared.setdefault(what, set()).add(self.pending[1])

    def declared_notes(self) -> list[str]:
        """The report's notes on ``--assume reads=N``: each line of the model's code it answered."""
        if self.read_note:
            return [f"{self.read_note}: {what}{f' ({len(modules)} places)' if len(modules) > 1 else ''}"
                    for what, modules in self.declared.items()]
        return [f"a value the model computes and reads was taken as declared with --assume reads={self.read_value}: "
                f"{what}{f' (in {len(modules)} modules)' if len(modules) > 1 else ''}; the peak holds for that value"
                for what, modules in self.declared.items()]

    def _bounded(self, func: Any, rule: Rule, args: Any, kwargs: Any, exc: Exception) -> Any:
        """Outputs at the op's largest size (``output_bounds`` rules), or at the declared
        fraction of it (``kept``), noted in the report: the peak is then an upper bound."""
        try:
            bound = output_bounds(rule, *_metas(args, kwargs))
        except NotImplementedError:
            raise exc from None
        most = hint_of(bound.count)  # with sizes as symbols, the trace is then not kept as a formula
        set_at_most = self.counts.most(args[0]) if func == torch.ops.aten.nonzero.default else None
        if set_at_most is not None:  # a mask made from zeros by setting some elements
            most = min(most, set_at_most)
        count = most if self.kept is None else min(most, math.ceil(most * self.kept))
        self.bounded = True
        outs = tuple(torch.empty(shape, dtype=dtype)
                     for shape, (_, dtype) in zip(bound.shapes(count), bound.outputs, strict=True))
        op = func.__name__.split(".")[0]
        if op in _INT8_OUTLIER_OPS and self.kept is None:  # one note for every int8 layer
            note = (f"upper bound (int8 base): {_INT8_OUTLIERS}recorded with every column an outlier, the most "
                    "there can be (declare a fraction with --assume nonzero=0.5)")
        elif op in _INT8_OUTLIER_OPS:
            note = (f"int8 base: {_INT8_OUTLIERS}recorded with {self.kept:g} of the columns outliers, as declared "
                    f"with --assume nonzero={self.kept:g}")
        else:
            name, module = _BOUNDED_NAMES.get(op, op), self.pending[1]
            where = f"{name} in {module}" if module else name
            if self.kept is None:
                note = (f"upper bound: {where} depends on values; recorded keeping {count:,} elements, the most "
                        "it can (declare a fraction with --assume nonzero=0.5)")
            else:
                note = (f"{where} depends on values; recorded keeping {count:,} of {most:,} elements, "
                        f"as declared with --assume nonzero={self.kept:g}")
        if note not in self.assumptions:
            self.assumptions.append(note)
        return outs[0] if len(outs) == 1 else outs

    def _refuse_what_the_real_kernel_refuses(self, func: Any, args: Any, kwargs: Any) -> None:
        """Fake and meta kernels accept some dtype mixes the real CPU kernel refuses (an int64
        or float16 input into a float32 Linear): when an op's tensors disagree in dtype, run it
        once on one-element real tensors of the same dtypes; if the real kernel refuses the
        dtypes, so does graphmem, with PyTorch's own message.  Cached per op and dtypes."""
        key = (func, tuple((t.dtype, t.dim()) if isinstance(t, torch.Tensor) else None
                           for t in tree_flatten((args, kwargs))[0]))
        if key not in self._dtype_checked:
            self._dtype_checked[key] = _real_dtype_error(func, args, kwargs)
        message = self._dtype_checked[key]
        if message:
            op, module = self.pending
            where = f"module {module}" if module else "the model"
            raise UserInputError(f"{where} runs {op.split('.')[1] if '.' in op else op} on inputs whose dtypes "
                                 f"PyTorch refuses: {message}; check the dtypes of --input (and --dtype)")

    def _replica_value(self) -> Any:
        if self._read_index >= len(self.scalar_reads):
            raise TraceError("the optimizer step read more tensor values than its one-element "
                             "replica did; its control flow depends on parameter sizes")
        self._read_index += 1
        return self.scalar_reads[self._read_index - 1]

    def _from_shadows(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The real answer of a value read, or fake outputs with the real (value-dependent) shapes."""
        real = self.shadows.run(func, args, kwargs)
        if not isinstance(real, (torch.Tensor, tuple, list)):
            return real
        fake = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
                        if isinstance(r, torch.Tensor) else r, real)
        self.shadows.attach(args, kwargs, fake, real)
        return fake

    def _from_values(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Fake outputs from the op's ``value_kernel`` rule, given the known values of its
        arguments (None: no rule, or a value it needs is unknown)."""
        rule = self._rules.value_kernels.get(func)
        if rule is None:
            return None
        known, sources = self.shadows.known_values(args, kwargs)
        with unset_fake_temporarily():  # the rule computes on the real values
            out = rule(*_metas(args, kwargs, known))
        if out is None:
            return None
        self.shadows.used |= sources
        return tree_map(lambda m: torch.empty_strided(m.shape, m.stride, dtype=m.dtype)
                        if isinstance(m, ArgMeta) else m, out)

    def _scratch(self, func: Any, args: Any, kwargs: Any) -> Any:
        rule = self._rules.scratch.get(func)
        if rule is None:
            return 0
        return scratch_bytes(rule, *_metas(args, kwargs))

    def _flops(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        rule = self._rules.flops.get(func)
        if rule is None:
            return count_flops(func, args, kwargs, out)
        return rule(*_metas(args, kwargs))

    def _fix_dtypes(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """Apply an op's output_dtypes and output_shapes rules (``fixed_outputs``)."""
        return fixed_outputs(self._rules, func, args, kwargs, out)

    def _add_node(self, func: Any, args: Any, kwargs: Any, out: Any) -> torch.fx.Node:
        node_args, node_kwargs = tree_map(self._node_of, (tuple(args), dict(kwargs)))
        node = self.graph.call_function(func, node_args, node_kwargs)
        node.meta["graphmem"] = {"op_index": len(self.ops)}
        if isinstance(out, torch.Tensor):
            self._nodes[out] = node
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self._nodes[item] = self.graph.call_function(operator.getitem, (node, i))
        return node

    def _node_of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):  # a size symbol: its value while recording
            return hint_of(value) if isinstance(value, torch.SymInt) else value
        node = self._nodes.get(value)
        if node is None:
            self._constants += 1
            node = self.graph.get_attr(f"_tensor_constant{self._constants}")
            self._nodes[value] = node
        return node

    def freeze(self) -> tuple[StorageRecord, ...]:
        """The storage records, final; call after the last poll."""
        return tuple(
            StorageRecord(sid=s.sid, nbytes=s.nbytes if (self.on_gpu is None or s.sid in self.on_gpu)
                          and s.sid not in self.mapped else 0,
                          created=s.created, released=s.released,
                          roles=frozenset(s.roles), label=s.label, shape=s.shape, dtype=s.dtype)
            for s in self.storages)


def _model_line() -> str:
    """The innermost line of the model's own code on the stack (not torch's, not graphmem's)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in ("/torch/", "/graphmem/", "<")):
            return linecache.getline(path, frame.f_lineno).split("  #")[0].strip()[:100]
        frame = frame.f_back  # type: ignore[assignment]
    return ""
