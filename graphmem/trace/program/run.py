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
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import torch
from torch import nn

from graphmem import progress
from graphmem._torch_api import (
    data_loading_in_process,
    module_children,
    quiet_fake_tensor_logs,
)
from graphmem.errors import TraceError
from graphmem.job.assume import Assumptions
from graphmem.job.program import Program
from graphmem.patching import environment, patched
from graphmem.records import Phase, Trace
from graphmem.trace.core.fake_mode import recording_fake_mode
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.program.backup import Backup, capturing_output
from graphmem.trace.program.books import Books, Enough, hooks
from graphmem.trace.program.effects import frame_kind, program_line, skipping_saves
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
_real_exit = os._exit  # the program's own os._exit is caught while it runs (exits_caught)

# graphmem run's own options, named in the error when a program that refused its argv got one
_RUN_OPTIONS = frozenset({"--steps", "--allow-network", "--write-through", "--device", "--format", "--units",
                          "--output", "-o", "--debug", "--timeout",
                          "--progress", "--no-progress", "--depth", "--top", "--timeline", "--snapshot", "--html",
                          "--gpu", "--sdpa", "--alloc-conf", "--budget", "--margin", "--nproc-per-node", "--nnodes",
                          "--ranks"})


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


# process-wide singletons a program sets up once and a second program in the same process may
# not change: accelerate's state (its device, "cuda" on a GPU target) is kept as it was before
_SINGLETONS = (("accelerate.state", ("PartialState", "AcceleratorState", "GradientState")),)


# the program's environment: transformers loads a checkpoint's tensors in a pool of threads
# unless told not to, and a thread's ops are not seen by the recording (dispatch modes belong
# to the thread that entered them); loaded in the program's thread, the same tensors result.
# Weights & Biases logs nothing and sends nothing (its runs are no-ops: a pre-flight is no run)
_ENVIRON = {"HF_DEACTIVATE_ASYNC_LOAD": "1", "WANDB_MODE": "disabled"}


def _singletons() -> list[dict[str, Any]]:
    """The shared state of each loaded singleton."""
    found = []
    for module_name, names in _SINGLETONS:
        module = sys.modules.get(module_name)
        for name in names:
            shared = getattr(getattr(module, name, None), "_shared_state", None)
            if isinstance(shared, dict):
                found.append(shared)
    return found


@contextlib.contextmanager
def _as_main(program: Program) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as Python sets them for the program, and ``_ENVIRON``;
    restored after, with the singletons of ``_SINGLETONS`` (the program may have made them
    for a fake GPU).  The program starts with those singletons empty, as in a new process: a
    rank's process forked from one that ran accelerate on one process must not inherit that
    state (it would not see torchrun's environment; accelerate's own ``_reset_state`` clears
    them the same)."""
    argv, path = sys.argv[:], sys.path[:]
    before = {id(shared): dict(shared) for shared in _singletons()}
    for shared in _singletons():
        shared.clear()
    sys.argv = [program.target, *program.argv]
    sys.path.insert(0, os.getcwd() if program.module else _script_folder(program.target))
    try:
        with environment(_ENVIRON):
            yield
    finally:
        sys.argv[:], sys.path[:] = argv, path
        for shared in _singletons():
            shared.clear()
            shared.update(before.get(id(shared), {}))


def _script_folder(target: str) -> str:
    """``sys.path[0]`` as python sets it for ``python TARGET``: the script's folder, or the
    folder itself when it is one (run through its ``__main__.py``)."""
    path = os.path.abspath(target)
    return path if os.path.isdir(path) else os.path.dirname(path)


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
    return traced


def _record(program: Program, gpu: GpuTarget | None, rank: int, cut: bool, mailbox: Mailbox | None,
            backup: Backup) -> ProgramTrace:
    """trace_program's work, in this process or (with its model whole) in the backup."""
    # the program holds its own tensors: each dies when it lets go of it (held: none); a value
    # the program reads (loss.item()) is 0: see the module docstring
    recorder = Recorder(rules_for("cuda" if gpu else "cpu"), Assumptions(reads=0), held=frozenset(),
                        read_note="the program read a value of a tensor, taken as 0", where=program_line)
    recorder.phase = Phase.PROGRAM
    recorder.answers.shadows.real_limit = None  # the program's own data is its own value, whatever its size
    books = Books(recorder, program.steps)
    fake_mode = recording_fake_mode()
    ending = _Ending()
    workers: list[int] = []
    groups: list[int] = []
    saves: list[str] = []
    exchange = Exchange(mailbox or Mailbox())
    exchanging = exchanging_stage_messages(exchange) if program.launched else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="graphmem-program-") as folder, contextlib.ExitStack() as capture:
        scratch = Scratch(os.path.join(folder, "layer"), program.write_through)
        held: list[Callable[[bool], None]] = []  # the cut try's output, written out once it stands
        # where the cut try's output is held: opened now, outside the program's file layer
        outputs = (tempfile.TemporaryFile(dir=folder), tempfile.TemporaryFile(dir=folder)) if cut else None
        for file in outputs or ():
            capture.callback(file.close)

        def fork_backup() -> bool:  # at the cut: True here (cut), False in the backup (whole)
            if not backup.fork():
                ending.pid = os.getpid()
                return False
            held.append(capture.enter_context(capturing_output(outputs)))
            return True

        backup.on_backup = lambda: scratch.detach(os.path.join(folder, "backup"))
        cuts = Cuts(decide=fork_backup)

        def snapshot(since: int) -> tuple[Trace, int]:  # the whole run so far (a cut stack placed whole)
            so_far = _trace(recorder, books, ())
            return _whole(so_far, cuts, books, since) if cuts.made else (so_far, since)

        on_gpu = on_the_gpu(recorder, gpu, snapshot) if gpu else contextlib.nullcontext()
        cutting = cutting_stacks(cuts, recorder.silenced) if cut else contextlib.nullcontext()
        try:
            with _as_main(program), quiet_fake_tensor_logs(), cutting, on_gpu, \
                    as_rank(program, rank, gpu is not None, recorder.books.resized, recorder.silenced,
                            recorder.books.hold, groups), exchanging, \
                    data_loading_in_process(workers.append), skipping_saves(saves), \
                    layered(scratch), without_network(program.allow_network), exits_caught(ending), \
                    loading_headers_only(recorder.books.map_from_file), fake_mode, recorder, hooks(books):
                _run(program, ending, books, cuts, exchange)
            if not ending.stopped:
                recorder.poll(everything=True)
            traced = _traced(program, recorder, books, cuts, exchange, gpu, groups, ending, saves, workers,
                             scratch.changes())
        except Spoiled as exc:
            if not backup.made:
                raise
            for keep in held:
                keep(False)
            capture.close()
            progress.show(f"recording the whole model ({exc})")
            kind, value = backup.resume()
            if kind == "raised":
                raise value from None
            traced, backends = value
            if gpu is not None:
                gpu.kernels.backends.clear()
                gpu.kernels.backends.update(backends)
            return traced  # type: ignore[no-any-return]
        except BaseException:
            backup.drop()
            raise
        backup.drop()
        capture.close()
        return traced


@dataclass
class _Ending:
    """How the program's run ended: stopped after the steps asked for, or by itself (and how)."""

    pid: int = field(default_factory=os.getpid)  # the program's process (its forked children are not it)
    stopped: bool = False
    failed: str | None = None  # how it failed after recording steps ("exited with status 1")


class _Exited(BaseException):
    """``os._exit(code)`` called by the program's own process: its run ends here."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def exits_caught(ending: _Ending) -> Iterator[None]:
    """Inside, ``os._exit`` in the program's own process ends its run as an exception would
    (the recording so far stands; its ``finally`` blocks run); in a process it forked
    (a DataLoader worker, a helper) it exits as always."""
    real = os._exit

    def exit_(code: int) -> NoReturn:
        if os.getpid() == ending.pid:
            raise _Exited(code)
        real(code)

    with patched((os, "_exit", exit_)):
        yield


def _run(program: Program, ending: _Ending, books: Books, cuts: Cuts, exchange: Exchange) -> None:
    """Run the program; note how it ended in ``ending`` (an exception after a step included)."""
    try:
        if program.module:
            runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program.target, run_name="__main__")
    except BaseException as exc:  # broad: the program is user code and may raise anything
        if os.getpid() != ending.pid:  # a process the program forked ran off its end: it ends here
            _end_forked_child(exc)
        if isinstance(exc, Enough):
            ending.stopped = True
        elif isinstance(exc, SystemExit | _Exited):
            code = exc.code
            if code not in (None, 0):
                _exit_message(code)
                how = f"called os._exit({code})" if isinstance(exc, _Exited) else _exit_status(code)
                if books.steps_done == 0:
                    raise TraceError(f"{program.command} {how} before its first optimizer step: "
                                     f"nothing to analyse{_options_hint(program)}") from None
                ending.failed = f"{program.command} {how} after {_steps_text(books.steps_done)}"
        elif isinstance(exc, Waits):
            exc.sent = dict(exchange.sent)
            raise
        elif isinstance(exc, Exception):
            if cuts.made:  # it may have failed for its model being cut: the whole model decides
                raise Spoiled(f"the program raised {type(exc).__name__} with its model cut") from exc
            if books.steps_done == 0:
                raise TraceError(_failure(program, exc, books.steps_done)) from exc
            ending.failed = _failure(program, exc, books.steps_done)
        else:
            raise
    else:
        if os.getpid() != ending.pid:
            _end_forked_child(None)


def _end_forked_child(exc: BaseException | None) -> NoReturn:
    """A process the program forked (``os.fork`` of its own) ran to the end of the program, or
    raised: it ends as Python would end it, without returning into graphmem's code."""
    code = 0
    if isinstance(exc, SystemExit | _Exited):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc, SystemExit):
            _exit_message(exc.code)
    elif exc is not None:
        code = 1
        with contextlib.suppress(BaseException):  # broad: the process must end
            traceback.print_exception(exc)
    with contextlib.suppress(BaseException):  # broad: the process must end
        sys.stdout.flush()
        sys.stderr.flush()
    _real_exit(code)


def _exit_message(code: object) -> None:
    """What Python prints for ``sys.exit(code)``: a code that is no int is written to stderr."""
    if code is not None and not isinstance(code, int):
        with contextlib.suppress(OSError, ValueError):
            print(code, file=sys.stderr)


def _exit_status(code: object) -> str:
    if isinstance(code, int):
        return f"exited with status {code}"
    return f"exited with status 1 ({' '.join(str(code).split())})"


def _steps_text(steps: int) -> str:
    return f"{steps} optimizer step{'s' * (steps != 1)}"


def _options_hint(program: Program) -> str:
    ours = [a for a in program.argv if a.split("=")[0] in _RUN_OPTIONS]
    return (f"; {', '.join(ours)} went to the program: graphmem's own options go before the script "
            "(everything after it is the program's argv)" if ours else
            ". graphmem run records a training program up to --steps optimizer steps")


def _traced(program: Program, recorder: Recorder, books: Books, cuts: Cuts, exchange: Exchange,
            gpu: GpuTarget | None, groups: list[int], ending: _Ending, saves: list[str], workers: list[int],
            changes: tuple[Change, ...]) -> ProgramTrace:
    """The recording as a ProgramTrace, the cut stack placed whole."""
    if books.steps_done == 0:
        raise TraceError(f"{program.command} ended before its first optimizer step: nothing to analyse"
                         f"{_options_hint(program)}")
    notes = _notes(program, recorder, books, ending.stopped, saves, workers, ending.failed is not None)
    trace, made = _trace(recorder, books, notes), None
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
                        communicators=sum(size > 1 for size in groups),
                        models=tuple(books.models), optimizers=tuple(books.optimizers), cut=made,
                        exchanged=exchange.result(), failed=ending.failed,
                        wrote=tuple(changes))


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


def _raising_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The frame that raised, when it is an installed library's or torch's (not graphmem's, not
    Python's own): the line a user looks at after their own."""
    if not frames:
        return None
    last = frames[-1]
    kind = frame_kind(last.filename)
    if kind == "library" or (kind == "torch" and "/torch/" in last.filename and "/graphmem/" not in last.filename):
        return last
    return None


def _failure(program: Program, exc: BaseException, steps: int) -> str:
    """The program's error, its traceback cut to the program's own frames (not torch's, not
    graphmem's, not runpy's, not an installed library's), then, where a library or torch
    raised it, the line that did."""
    frames = traceback.extract_tb(exc.__traceback__)
    shown = [f for f in frames if frame_kind(f.filename) == "program"][-5:]
    raised = _raising_frame(frames)
    if raised is not None and (not shown or shown[-1] is not raised):
        shown.append(raised)
    where = "".join(f"\n  {f.filename}:{f.lineno}: {(f.line or '').strip()}" for f in shown)
    after = f" after {steps} optimizer step{'s' * (steps != 1)}"
    return f"{program.command} raised {type(exc).__name__}: {str(exc).strip()}{after}{where}"
