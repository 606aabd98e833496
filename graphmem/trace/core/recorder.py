"""The dispatch-level recorder behind stage 2 (trace).

A TorchDispatchMode that sits above FakeTensorMode and sees every aten op the step
dispatches, in execution order: forward, the autograd engine's backward, the optimizer.
For each op it appends an ``OpRecord`` and an fx node (``GraphBuilder``); its storages go to
the books (``StorageBooks``: size, roles, creation, release), its module comes from the
``ModuleTracker``, and a read of values fake tensors do not hold is answered by
``ValueAnswers`` (graphmem.trace.values.answers); recording a program (``where`` given), the
reads Python makes without an op (``repr``, ``numpy()``, ``copy.deepcopy``) are answered too,
while the recorder is entered (graphmem.trace.values.reads).  Releases come from the same
reference counting that frees memory in a real run (Python references, autograd's saved
tensors, the optimizer's state), so they are observed, not guessed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphmem._torch_api import (
    DATA_DEPENDENT_ERRORS,
    HigherOrderOperator,
    TorchDispatchMode,
    count_flops,
    current_autograd_node,
    expr_of,
    hint_of,
    tree_flatten,
)
from graphmem.job.assume import Assumptions
from graphmem.process import interrupts, progress
from graphmem.records import OpRecord, Phase, Role, StorageRecord
from graphmem.trace.core.graph import GraphBuilder
from graphmem.trace.core.modules import ModuleTracker
from graphmem.trace.core.outputs import DtypeChecks, fixed_outputs, fresh_outputs
from graphmem.trace.core.storages import HELD, StorageBooks
from graphmem.trace.rules import ops
from graphmem.trace.rules.registry import RuleTable, metas, scratch_bytes
from graphmem.trace.values.answers import ValueAnswers
from graphmem.trace.values.reads import reading_values

__all__ = ["Recorder"]

_FAKES_ON = torch.device("cpu")
_NOTHING = object()  # no entry in a weak table
# higher-order ops recorded as one op, their outputs from their fake kernel: FlexAttention's,
# one fused kernel each on a GPU (torch.compile'd, as every program runs them), so no score
# matrix is ever materialised.  Any other higher-order op is refused, as before.
_ONE_KERNEL = frozenset({"flex_attention", "flex_attention_backward"})
_PROGRESS_EVERY = 4096  # recorded ops between progress lines
_MULTI_TENSOR = ("aten::_foreach_", "aten::_fused_")  # ops over lists of tensors (OpRecord.listed)
# ops of torch.distributed's collectives and FSDP2's copies in and out of their buffers
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "fsdp"})
# ops whose real kernel returns its input tensor itself, where the fake kernel makes a new one
# (functional collectives' wait: c10d/Functional.cpp wait_tensor returns ``self``)
_RETURNS_INPUT = frozenset(op for op in (getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None),)
                           if op is not None)


class Recorder(TorchDispatchMode):
    """Records ops and storage lifetimes; see the module docstring.

    Args:
        rules: the per-op rules of the target device.
        assume: what the user declared about values graphmem does not see.
        held: roles whose tensors graphmem holds for the whole recording (none in a program).
        read_note: how notes name the source of ``assume.reads`` when it is not ``--assume``.
        where: graphmem run: the program's line running now, for each op and each read's note.
        python_reads: answer Python's reads of fake tensors' values while entered (``repr``,
            ``numpy()``, ``copy.deepcopy``: graphmem.trace.values.reads); default: with ``where``.
    """

    def __init__(self, rules: RuleTable, assume: Assumptions | None = None, *, held: frozenset[Role] = HELD,
                 read_note: str = "", where: Callable[[], str] | None = None,
                 python_reads: bool | None = None) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.books = StorageBooks(self.ops, held)
        self.modules = ModuleTracker(self.books)
        self.fx = GraphBuilder()
        self.assumptions: list[str] = []  # the report's notes on what the recording rests on
        self.answers = ValueAnswers(rules, assume or Assumptions(), self.assumptions, read_note, where)
        self._reads = contextlib.ExitStack() if (where is not None if python_reads is None else python_reads) else None
        self._entered = 0
        self.phase, self.iteration = Phase.FORWARD, 0
        self.loss: str | None = None  # training: which loss the step took (graphmem.trace.step.optim.loss_taken)
        self.pending: tuple[str, str] = ("", "")  # the op being recorded and its module, for errors
        self.silent = False  # ops run now are graphmem's own (or after a program's last step): not recorded
        self.where = where
        # sizes as symbols (graphmem.trace.symbolic): op index -> (scratch bytes, flops) as
        # expressions, for the ops where either is one
        self.op_sizes: dict[int, tuple[Any, Any]] = {}
        self.dispatching = 0  # > 0 while an op runs (torch's kernels, not the program's code)
        self.host_asked = 0  # > 0 while the program's own Python code asks for the CPU (device="cpu", .cpu())
        self._rules = rules
        self._dtypes = DtypeChecks()

    def mark(self, t: torch.Tensor, role: Role, label: str = "", owner: str = "") -> None:
        """Give ``t``'s storage a role, a name, and the parameter it belongs to (``StorageBooks.mark``)."""
        self.books.mark(t, role, label, owner)

    def poll(self, everything: bool = False) -> None:
        """Note every storage released since the last op (``StorageBooks.poll``)."""
        self.books.poll(everything)

    def add_placeholder(self, t: torch.Tensor, name: str) -> None:
        self.fx.add_placeholder(t, name)

    def freeze(self) -> tuple[StorageRecord, ...]:
        """The storage records, final; call after the last poll."""
        return self.books.freeze()

    @contextlib.contextmanager
    def swapping(self, t1: torch.Tensor, t2: torch.Tensor, kept: tuple[Any, ...] = ()) -> Iterator[None]:
        """Inside, ``torch.utils.swap_tensors(t1, t2)`` can run: it refuses tensors with weak
        references, and the recorder holds one on every tensor it saw (``Module._apply`` swaps
        a DTensor parameter's contents so, keeping the Parameter).  The recorder lets go of
        both, and takes them back after: what it knew of ``t2``'s values (its fx node, its
        shadow) it now knows of ``t1``, which holds them, and the other way round; what it knew
        of each tensor itself (a parameter: no shadow follows it) stays with it.  ``kept``: the
        caller's own weak tables of tensors themselves (a parameter's name)."""
        values, own = self.answers.weak_tables()
        tables = [(table, True) for table in (*self.fx.weak_tables(), *values)]
        tables += [(table, False) for table in (*own, *kept)]
        held = [(table, swap, [table.pop(t, _NOTHING) for t in (t1, t2)]) for table, swap in tables]
        watched = [self.books.unwatch(t) for t in (t1, t2)]
        done = False
        try:
            yield
            done = True
        finally:  # a swap that failed swapped nothing: all taken back as it was
            for table, swap, (first, second) in held:
                for t, value in ((t1, second), (t2, first)) if swap and done else ((t1, first), (t2, second)):
                    if value is not _NOTHING:
                        table[t] = value
            if any(watched):  # each now holds the other's storage: watched again, on it
                for t in (t1, t2):
                    self.books.track(t, len(self.ops) - 1)

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """Ops run inside are graphmem's own bookkeeping: not recorded."""
        self.silent = True
        try:
            yield
        finally:
            self.silent = False

    def __enter__(self) -> Recorder:
        if self._reads is not None and not self._entered:
            self._reads.enter_context(reading_values(self.answers))
        self._entered += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._entered -= 1
            if self._reads is not None and not self._entered:
                self._reads.close()

    supports_higher_order_operators = True  # FlexAttention's reach __torch_dispatch__ (_ONE_KERNEL)
    # graphmem run, the CPU target: torch.compile'd code is compiled with the recorder entered
    # (graphmem.trace.compiled), where dynamo would otherwise run it eagerly
    compiles = False

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]  # torch's is a classmethod
        return self.compiles

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator) and func.name() not in _ONE_KERNEL:
            return NotImplemented
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, torch.device) and (device.type == "cuda" or device.index is not None
                                                 and device.type == "cpu"):
            # the user's device="cuda": the fakes live on the CPU (graphmem.job.devices); "cpu:0"
            # (torchrun programs' torch.device("cpu", LOCAL_RANK)): a real CPU tensor's device is
            # "cpu" whatever the index asked for, a fake one would keep it and refuse to meet "cpu"
            kwargs = {**kwargs, "device": _FAKES_ON}
        self.dispatching += 1
        try:
            return self._dispatch(func, args, kwargs, device)
        finally:
            self.dispatching -= 1

    def _dispatch(self, func: Any, args: Any, kwargs: Any, device: Any) -> Any:
        if self.silent or func.namespace in ("prim", "profiler") or func in ops.SIZE_QUERIES:  # queries, marks
            return func(*args, **kwargs)
        interrupts.check()  # a safe point for Ctrl-C (graphmem.process.interrupts): an op about to be recorded
        self.poll()
        index = len(self.ops)
        in_tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                      and func not in ops.LIFTS]  # a lift's input is the real constant it fakes
        in_sids = self._sids(in_tensors, index)
        module = self.modules.current(self.phase, in_sids, self.ops)
        if self.phase in (Phase.FORWARD, Phase.LOSS):
            self.modules.note_sequence(module)
        self.pending = (str(func), module)  # named in the error if the op raises
        kernel = isinstance(func, HigherOrderOperator)  # one of _ONE_KERNEL: run as it is
        if self.phase in (Phase.FORWARD, Phase.LOSS) and len({t.dtype for t in in_tensors}) > 1 and not kernel:
            self._dtypes.refuse(func, args, kwargs, str(func), module)
        scratch = self._scratch(func, args, kwargs)
        out = func(*args, **kwargs) if kernel else \
            fixed_outputs(self._rules, func, args, kwargs, fresh_outputs(func, self._run(func, args, kwargs)))
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_sids = self._sids(out_tensors, index)
        if self.books.on_gpu is not None:
            scratch = scratch if self.books.place(device, in_sids, out_sids, bool(self.host_asked)) else 0
        if func.namespace in _COLLECTIVES:
            for sid in out_sids:
                self.books.storages[sid].roles.add(Role.COMMUNICATION)
        self.fx.add_op(func, args, kwargs, out, index)
        recompute = self.phase == Phase.BACKWARD and bool(self.modules.stack)
        if index % _PROGRESS_EVERY == 0 and progress.active():
            where = f", at {self.where()}" if self.where is not None else ""  # graphmem run: the program's line
            progress.show(f"recording: iteration {self.iteration + 1}, {self.phase.value}, {index:,} ops{where}")
        flops = self._flops(func, args, kwargs, out)
        if isinstance(scratch, torch.SymInt) or isinstance(flops, torch.SymInt):
            self.op_sizes[index] = (expr_of(scratch), expr_of(flops))
            scratch, flops = hint_of(scratch), hint_of(flops)
        listed = tuple(self.books.track(t, index).sid for t in in_tensors) \
            if len(in_tensors) > len(in_sids) and func.name().startswith(_MULTI_TENSOR) else ()  # cheap test first
        self.ops.append(OpRecord(index=index, op=str(func), phase=self.phase,
                                 iteration=self.iteration, module=module, inputs=in_sids,
                                 outputs=out_sids, scratch_bytes=scratch, flops=flops, recompute=recompute,
                                 line=self.where() if self.where is not None else "", listed=listed))
        return out

    def _sids(self, tensors: list[torch.Tensor], index: int) -> tuple[int, ...]:
        """The storages of ``tensors``, each once, in order (a sparse tensor's: its parts')."""
        track, track_all = self.books.track, self.books.track_all
        return tuple(dict.fromkeys(rec.sid for t in tensors for rec in (
            (track(t, index),) if t.layout is torch.strided else track_all(t, index))))

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run the op on fake tensors.  A value the optimizer step reads comes from the real
        one-element replica (graphmem.trace.step.replica), in order; a value or value-dependent
        shape the model reads from ``ValueAnswers``."""
        if func == ops.READ and self.phase == Phase.OPTIMIZER and self.answers.replica_active:
            return self.answers.replica_value()
        if func.overloadpacket in _RETURNS_INPUT:
            func(*args, **kwargs)
            return args[0]
        try:
            out = self.answers.sized(func, args, kwargs, func(*args, **kwargs))
        except DATA_DEPENDENT_ERRORS as exc:
            return self.answers.answer(func, args, kwargs, exc, self.pending[1])
        if self.phase in (Phase.FORWARD, Phase.LOSS) or (self.phase == Phase.BACKWARD and self.modules.stack):
            # the forward, and its recompute in backward (activation checkpointing: the same
            # values are read again, and answered as the first time)
            self.answers.follow(func, args, kwargs, out)
        elif self.phase == Phase.PROGRAM or (self.phase == Phase.BACKWARD and self.where is not None
                                             and current_autograd_node() is None):
            # graphmem run: the program's data code, with the program's values; in the backward
            # phase, its code outside the autograd engine (with gradient accumulation the phase
            # lasts to the last micro-batch: nanoGPT fetches the next batch there)
            self.answers.follow(func, args, kwargs, out, model=False)
        return out

    def _scratch(self, func: Any, args: Any, kwargs: Any) -> Any:
        rule = self._rules.scratch.get(func)
        if rule is None:
            return 0
        return scratch_bytes(rule, *metas(args, kwargs))

    def _flops(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        rule = self._rules.flops.get(func)
        if rule is None:
            return count_flops(func, args, kwargs, out)
        return rule(*metas(args, kwargs))
