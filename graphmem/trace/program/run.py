"""A training program recorded as it runs (``graphmem run``).

Input: a script (or ``-m`` module), its own argv, how many optimizer steps to record.
Output: a ``ProgramTrace``: the ``Trace`` of every aten op the program dispatched from its
first line to the end of its K-th optimizer step, and what the run did (steps, how it ended,
what was left out).  Knows nothing of categories, peaks, reports or the command line.

How: the program runs as ``python SCRIPT ARGS`` would run it (``__main__``, ``sys.argv``,
``sys.path[0]``) under the recording fake mode with the ``Recorder`` on top, so every tensor
it makes is a fake one (no memory, no weights) and every op is seen.  Global hooks give the
books what analyze's driver knows by construction: a module called from outside any module is
a model (its parameters and buffers named from it, its tensor arguments the inputs, its outputs
the outputs), autograd's ``backward`` is the backward phase, the optimizer's step (any
torch.optim optimizer) the optimizer phase, its gradients and its state named there.  After
the K-th step the program is stopped with an exception no ``except Exception`` catches, so its
``finally`` blocks run (unrecorded).

Values: a fake tensor holds none.  A value the optimizer step reads (Adam's step count) comes
from a real copy of the program's optimizer on one-element parameters, stepped alongside it
(graphmem.trace.step.replica's idea); any other read (``loss.item()`` for a log line) is taken
as 0 and noted, with the program's line.
"""

from __future__ import annotations

import collections
import contextlib
import os
import runpy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from graphmem._torch_api import (
    data_loading_in_process,
    module_children,
    quiet_fake_tensor_logs,
)
from graphmem.errors import TraceError
from graphmem.job.assume import Assumptions
from graphmem.job.program import Program
from graphmem.process import progress
from graphmem.records import Phase, Trace
from graphmem.trace.compiled import compiler_folders
from graphmem.trace.core.fake_mode import recording_fake_mode
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.program.as_main import as_main
from graphmem.trace.program.backup import Backup, capturing_output
from graphmem.trace.program.books import Books, Enough, hooks
from graphmem.trace.program.effects import program_line, skipping_saves
from graphmem.trace.program.ending import (
    Ending,
    Exited,
    end_forked_child,
    exit_message,
    exit_status,
    exits_caught,
    failure,
    steps_text,
)
from graphmem.trace.program.gpu import GpuTarget, on_the_gpu
from graphmem.trace.program.loads import loading_headers_only
from graphmem.trace.program.network import without_network
from graphmem.trace.program.ranks import as_rank
from graphmem.trace.program.scratch import Change, Scratch, layered
from graphmem.trace.program.stacks import Cuts, Spoiled, cutting_stacks
from graphmem.trace.program.stage_messages import Exchange, Exchanged, Mailbox, Waits, exchanging_stage_messages
from graphmem.trace.repeat.place import Unrepeatable, placed_calls, repeat_program
from graphmem.trace.rules import rules_for

__all__ = ["ProgramTrace", "Spoiled", "trace_program"]

_NOWHERE = "\x00"  # a module path no module has

@dataclass(frozen=True)
class ProgramTrace:
    """The recording of a program, and how its run went."""

    trace: Trace
    steps: int  # optimizer steps recorded
    stopped: bool  # stopped after the steps asked for (else: the program ended by itself)
    models: tuple[str, ...]  # the classes of the modules it called, in order of first call
    optimizers: tuple[str, ...]  # the classes of the optimizers it stepped
    communicators: int = 0  # process groups of more than one rank it made (NCCL: a communicator each)
    # the stack the recording cut (graphmem.trace.program.stacks): its module path in the model
    # and the blocks the program built; None when the model was recorded whole
    cut: tuple[str, int] | None = None
    # what its pipeline stages sent each other (graphmem.trace.program.stage_messages)
    exchanged: Exchanged = field(default_factory=Exchanged)
    # how it failed after recording steps ("python train.py exited with status 1 after 1 optimizer step")
    failed: str | None = None
    # what it did to files, in its own layer (graphmem.trace.program.scratch): the real files are unchanged
    wrote: tuple[Change, ...] = ()
    sdpa_backends: dict[str, int] = field(default_factory=dict)  # on a GPU: the attention kernels chosen, calls each


def trace_program(program: Program, *, gpu: GpuTarget | None = None, rank: int = 0,
                  cut: bool = False, mailbox: Mailbox | None = None) -> ProgramTrace:
    """Run ``program`` under the recorder until its ``program.steps``-th optimizer step ends:
    on the CPU, or with ``gpu`` its "cuda" that GPU (graphmem.trace.program.gpu); as ``rank``
    of its ``nproc_per_node`` (graphmem.trace.program.ranks), its pipeline stages receiving
    what the ranks recorded before sent (``mailbox``; graphmem.trace.program.stage_messages).
    With ``cut``, its model's stack of alike blocks is recorded as four (graphmem.trace.program.
    stacks), a backup of the program kept whole from that moment (graphmem.trace.program.backup):
    the program starts once, whichever recording stands.

    Raises:
        TraceError: the program raised, or ended or exited, before its first optimizer step.
        Waits: a pipeline stage needs a message from a rank not yet recorded (with what this
            recording had sent).
    """
    backup = Backup()
    try:
        traced = _record(program, gpu, rank, cut, mailbox, backup)
    except BaseException as exc:
        if backup.in_backup:  # the backup's recording ends here, and so does its process
            backup.send("raised", exc)
        raise
    if backup.in_backup:
        backup.send("result", (replace(traced, trace=replace(traced.trace, fx=torch.fx.Graph())),
                               dict(gpu.kernels.backends) if gpu else {}))
    return replace(traced, sdpa_backends=dict(gpu.kernels.backends)) if gpu else traced


def _record(program: Program, gpu: GpuTarget | None, rank: int, cut: bool, mailbox: Mailbox | None,
            backup: Backup) -> ProgramTrace:
    """trace_program's work, in this process or (with its model whole) in the backup."""
    recorder = _program_recorder(gpu)
    books, ending, exchange = Books(recorder, program.steps), Ending(), Exchange(mailbox or Mailbox())
    with tempfile.TemporaryDirectory(prefix="graphmem-program-") as folder, contextlib.ExitStack() as capture:
        scratch = Scratch(os.path.join(folder, "layer"), (*program.write_through, *compiler_folders()))
        held: list[Callable[[bool], None]] = []  # the cut try's output, written out once it stands
        # where the cut try's output is held: opened now, outside the program's file layer
        outputs = (tempfile.TemporaryFile(dir=folder), tempfile.TemporaryFile(dir=folder)) if cut else None
        for file in outputs or ():
            capture.callback(file.close)
        backup.on_backup = lambda: scratch.detach(os.path.join(folder, "backup"))
        cuts = Cuts(decide=partial(_fork_backup, backup, ending, lambda: held.append(
            capture.enter_context(capturing_output(outputs)))))
        run = _Run(program, gpu, recorder, books, cuts, exchange, scratch, ending)
        try:
            traced = _recorded(run, rank, cut)
        except Spoiled as exc:
            if not backup.made:
                raise
            for keep in held:
                keep(False)
            capture.close()
            return _resumed(backup, gpu, exc)
        except BaseException:
            backup.drop()
            raise
        backup.drop()
        capture.close()
        return traced


@dataclass(frozen=True)
class _Run:
    """One recording of the program: its recorder, and what its hooks note as it runs."""

    program: Program
    gpu: GpuTarget | None
    recorder: Recorder
    books: Books
    cuts: Cuts
    exchange: Exchange
    scratch: Scratch
    ending: Ending
    workers: list[int] = field(default_factory=list)  # the data loaders' worker processes asked for
    groups: list[int] = field(default_factory=list)  # the sizes of the process groups it made
    saves: list[str] = field(default_factory=list)  # the checkpoint saves skipped


def _program_recorder(gpu: GpuTarget | None) -> Recorder:
    """The recorder of a program: it holds its own tensors, each dies when it lets go of it
    (held: none); a value it reads (loss.item()) is 0: see the module docstring."""
    recorder = Recorder(rules_for("cuda" if gpu else "cpu"), Assumptions(reads=0), held=frozenset(),
                        read_note="the program read a value of a tensor, taken as 0", where=program_line)
    recorder.phase = Phase.PROGRAM
    recorder.answers.shadows.real_limit = None  # the program's own data is its own value, whatever its size
    return recorder


def _fork_backup(backup: Backup, ending: Ending, capture: Callable[[], None]) -> bool:
    """At the cut: True here (cut, its output captured), False in the backup (whole)."""
    if not backup.fork():
        ending.pid = os.getpid()
        return False
    capture()
    return True


def _recorded(run: _Run, rank: int, cut: bool) -> ProgramTrace:
    """The program run under the recorder, with every context it runs in, then its recording."""
    program, recorder, gpu = run.program, run.recorder, run.gpu
    exchanging = exchanging_stage_messages(run.exchange) if program.launched else contextlib.nullcontext()
    on_gpu = on_the_gpu(recorder, gpu, partial(_snapshot, run)) if gpu else contextlib.nullcontext()
    cutting = cutting_stacks(run.cuts, recorder.silenced) if cut else contextlib.nullcontext()
    fake_mode = recording_fake_mode()
    with as_main(program), quiet_fake_tensor_logs(), cutting, on_gpu, \
            as_rank(program, rank, gpu is not None, recorder.books.resized, recorder.silenced,
                    recorder.books.hold, run.groups), exchanging, \
            data_loading_in_process(run.workers.append), skipping_saves(run.saves), \
            layered(run.scratch), without_network(program.allow_network), exits_caught(run.ending), \
            loading_headers_only(recorder.books.map_from_file), fake_mode, recorder, hooks(run.books):
        _run(program, run.ending, run.books, run.cuts, run.exchange)
    if not run.ending.stopped:
        recorder.poll(everything=True)
    return _traced(run)


def _snapshot(run: _Run, since: int) -> tuple[Trace, int]:
    """The whole run so far (a cut stack placed whole), and where its op ``since`` is in it."""
    so_far = _trace(run.recorder, run.books, ())
    return _whole(so_far, run.cuts, run.books, since) if run.cuts.made else (so_far, since)


def _resumed(backup: Backup, gpu: GpuTarget | None, spoiled: Spoiled) -> ProgramTrace:
    """The backup's recording of the whole model, the cut one not standing (``spoiled``)."""
    progress.show(f"recording the whole model ({spoiled})")
    kind, value = backup.resume()
    if kind == "raised":
        raise value from None
    traced, backends = value
    if gpu is not None:
        gpu.kernels.backends.clear()
        gpu.kernels.backends.update(backends)
    return traced  # type: ignore[no-any-return]


def _run(program: Program, ending: Ending, books: Books, cuts: Cuts, exchange: Exchange) -> None:
    """Run the program; note how it ended in ``ending`` (an exception after a step included)."""
    try:
        if program.module:
            runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program.target, run_name="__main__")
    except BaseException as exc:  # broad: the program is user code and may raise anything
        if os.getpid() != ending.pid:  # a process the program forked ran off its end: it ends here
            end_forked_child(exc)
        if isinstance(exc, Enough):
            ending.stopped = True
        elif isinstance(exc, SystemExit | Exited):
            code = exc.code
            if code not in (None, 0):
                exit_message(code)
                how = f"called os._exit({code})" if isinstance(exc, Exited) else exit_status(code)
                if books.steps_done == 0:
                    raise TraceError(f"{program.command} {how} before its first optimizer step: "
                                     f"nothing to analyse{_options_hint(program)}") from None
                ending.failed = f"{program.command} {how} after {steps_text(books.steps_done)}"
        elif isinstance(exc, Waits):
            exc.sent = dict(exchange.sent)
            raise
        elif isinstance(exc, Exception):
            if cuts.made:  # it may have failed for its model being cut: the whole model decides
                raise Spoiled(f"the program raised {type(exc).__name__} with its model cut") from exc
            if books.steps_done == 0:
                raise TraceError(failure(program, exc, books.steps_done)) from exc
            ending.failed = failure(program, exc, books.steps_done)
        else:
            raise
    else:
        if os.getpid() != ending.pid:
            end_forked_child(None)


def _options_hint(program: Program) -> str:
    ours = [a for a in program.argv if a.split("=")[0] in program.own_options]
    return (f"; {', '.join(ours)} went to the program: graphmem's own options go before the script "
            "(everything after it is the program's argv)" if ours else
            ". graphmem run records a training program up to --steps optimizer steps")


def _traced(run: _Run) -> ProgramTrace:
    """The recording as a ProgramTrace, the cut stack placed whole."""
    program, books, cuts, gpu, ending = run.program, run.books, run.cuts, run.gpu, run.ending
    if books.steps_done == 0:
        raise TraceError(f"{program.command} ended before its first optimizer step: nothing to analyse"
                         f"{_options_hint(program)}")
    notes = _notes(program, run.recorder, books, ending.stopped, run.saves, run.workers, ending.failed is not None)
    trace, made = _trace(run.recorder, books, notes), None
    if cuts.made:
        container = cuts.made[0].container
        if id(container) not in books.paths:  # never run by the program: nothing to place it by
            raise Spoiled("the stack cut was never run")
        made = (books.paths[id(container)], cuts.made[0].length)
        cut_trace, (trace, _) = trace, _whole(trace, cuts, books, len(trace.ops))
        if gpu is not None:  # the attention kernels, counted as the whole model calls them
            calls = gpu.kernels.calls
            times = placed_calls(cut_trace, made[0], made[1], [position for _, position in calls],
                                 named=_named(cuts, books))
            gpu.kernels.backends.clear()
            for (backend, _), n in zip(calls, times, strict=True):
                if n:
                    gpu.kernels.backends[backend] = gpu.kernels.backends.get(backend, 0) + n
    return ProgramTrace(trace=trace, steps=books.steps_done, stopped=ending.stopped,
                        communicators=sum(size > 1 for size in run.groups),
                        models=tuple(books.models), optimizers=tuple(books.optimizers), cut=made,
                        exchanged=run.exchange.result(), failed=ending.failed,
                        wrote=tuple(run.scratch.changes()))


def _named(cuts: Cuts, books: Books) -> dict[int, int]:
    """Storage -> block for the cut stack's tensors the program holds now: each block's
    parameters, their gradients and its buffers; the model's other ones -> -1 (outside)."""
    named: dict[int, int] = {}
    storages = books.recorder.books

    def tensors(module: nn.Module) -> list[torch.Tensor]:
        return [*(t for p in module.parameters() for t in (p, p.grad) if t is not None), *module.buffers()]

    cut = cuts.made[0]
    for b, block in enumerate(module_children(cut.container).values()):
        for t in tensors(block) if block is not None else ():
            sid = storages.sid_of(t)
            if sid is not None:
                named.setdefault(sid, b)
    for t in tensors(cut.model):
        sid = storages.sid_of(t)
        if sid is not None:
            named.setdefault(sid, -1)
    return named


def _whole(trace: Trace, cuts: Cuts, books: Books, since: int) -> tuple[Trace, int]:
    """The whole program's trace from ``trace``, recorded with its stack cut
    (graphmem.trace.repeat.place.repeat_program), and where its op ``since`` is in it;
    ``Spoiled`` when the recording does not repeat by offset."""
    cut = cuts.made[0]
    prefix = books.paths.get(id(cut.container), _NOWHERE)  # none before the model first ran: nothing named
    try:
        whole, at = repeat_program(trace, prefix, cut.length, named=_named(cuts, books), since=since)
    except Unrepeatable as exc:
        raise Spoiled(str(exc)) from exc
    return replace(whole, fx=torch.fx.Graph()), at  # (graphmem run draws no graph)


def _notes(program: Program, recorder: Recorder, books: Books, stopped: bool, saves: list[str],
           workers: list[int], failed: bool = False) -> tuple[str, ...]:
    """What the report says of the run: declared reads, updates by hand, an early end, skipped
    saves, data loading in process."""
    notes = list(recorder.answers.declared_notes())
    done = books.steps_done
    for calls, name in books.closure_calls.values():
        notes.append(f"{name}'s step called the program's closure {calls} times over {done} step{'s' * (done > 1)}: "
                     "as often as its settings allow (max_iter), the loss taken as falling every time; a real "
                     "run that converges sooner calls it less often and keeps a shorter history")
    if books.by_hand:
        notes.append("the program updates its parameters itself (no torch.optim optimizer): each step is a "
                     "backward pass and what follows it, up to the next forward")
    if not stopped and done < program.steps and not failed:
        notes.append(f"the program ended after {done} step{'s' * (done > 1)} (--steps {program.steps} asked for more)")
    for what, count in collections.Counter(saves).items():
        notes.append(f"a checkpoint save was skipped (the tensors are fakes; nothing was written): {what}"
                     + (f", {count} times" if count > 1 else ""))
    if workers:
        notes.append(f"the data loader{'s' * (len(workers) > 1)} loaded in the program's process, not in "
                     f"{max(workers)} worker processes: the same batches, and the GPU's memory is the same")
    return tuple(notes)


def _trace(recorder: Recorder, books: Books, notes: tuple[str, ...]) -> Trace:
    """The run recorded so far as a ``Trace`` (storages still live have no release)."""
    return Trace(mode="train", fx=recorder.fx.graph, ops=tuple(recorder.ops), storages=recorder.freeze(),
                 optimizer=books.optimizers[0] if books.optimizers else None, assumptions=notes)
