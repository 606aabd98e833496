"""The ranks of a program recorded, as torchrun launches them (``graphmem run``).

Input: a ``Program`` (its ranks to record among them) and, for a GPU, what makes each
recording's ``GpuTarget``.  Output: a ``Launched``: each recorded rank's ``ProgramTrace``, and
why ranks the program did not name were recorded.  Recording only: what the traces weigh is
the caller's (graphmem.memory).

Each rank is a process of its own (graphmem.process.workers.fork_each), as torchrun starts them, with
its own imports; its model's stack of alike blocks recorded once (graphmem.trace.program.stacks).
A pipelined program's stages tell each other shapes at run time: the ranks are recorded in
rounds until the messages agree (graphmem.trace.program.stage_messages).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from graphmem.errors import TraceError
from graphmem.job.program import Program
from graphmem.process import progress
from graphmem.process.workers import fork_each
from graphmem.trace.program.gpu import GpuTarget
from graphmem.trace.program.run import ProgramTrace, trace_program
from graphmem.trace.program.stage_messages import Key, Mailbox, Waits

__all__ = ["Launched", "record_program", "record_rounds"]

# records the ranks of ``ranks`` reading the messages of ``mailbox``: each rank's trace, or what it waits for
RecordRanks = Callable[[Sequence[int], Mailbox], list[ProgramTrace | Waits]]


@dataclass(frozen=True)
class Launched:
    """The recorded ranks of a program."""

    traces: dict[int, ProgramTrace]  # by rank
    # why ranks the program did not name were recorded ("2, 3: each pipeline stage's first rank")
    added: tuple[str, ...] = ()


def record_program(program: Program, gpu: Callable[[], GpuTarget] | None = None) -> Launched:
    """The program's ranks (``program.chosen_ranks``) recorded until its pipeline stages' messages
    agree; ``gpu`` makes each recording's GPU (None: the CPU).  Each rank's model's stack of alike
    blocks is recorded once unless ``GRAPHMEM_REPEATED_BLOCKS=0``.  With several processes, the
    traces come back without their fx graph.

    Raises:
        TraceError: the program raised before its first optimizer step, or its ranks wait for
            each other (record_rounds).
    """
    cut = os.environ.get("GRAPHMEM_REPEATED_BLOCKS", "1") != "0"
    traces, added = record_rounds(partial(_record_ranks, program, gpu, cut), program.chosen_ranks,
                                  stage_ranks=program.ranks is None)
    return Launched(traces, added)


def _record_ranks(program: Program, gpu: Callable[[], GpuTarget] | None, cut: bool,
                  ranks: Sequence[int], mailbox: Mailbox) -> list[ProgramTrace | Waits]:
    """One round: each of ``ranks`` recorded, a process each when the program has several."""
    attempt = partial(_attempt, program, gpu, cut, mailbox)
    if program.world_size > 1:  # each rank a process of its own, as torchrun starts them: its own imports
        return fork_each(attempt, ranks, what="running a rank of the program")
    return [attempt(rank) for rank in ranks]


def _attempt(program: Program, gpu: Callable[[], GpuTarget] | None, cut: bool, mailbox: Mailbox,
             rank: int) -> ProgramTrace | Waits:
    """The rank recorded with its model's stack of alike blocks cut to four (``cut``;
    graphmem.trace.program.stacks), a backup of the program kept whole from that moment in case
    the cut recording does not stand: the program starts once (graphmem.trace.program.backup).
    What it waits for when a pipeline stage needs a message not yet sent."""
    target = gpu() if gpu is not None else None
    progress.show(f"running {program.command}" + (f" as rank {rank}" if program.world_size > 1 else "")
                  + (", its model's repeated blocks recorded once" if cut else ""))
    try:
        traced = trace_program(program, gpu=target, rank=rank, cut=cut, mailbox=mailbox)
    except Waits as waits:  # recorded again once the rank it waits for is
        return waits
    if program.world_size > 1:  # back from a process of its own: a graph does not pickle
        traced = replace(traced, trace=replace(traced.trace, fx=torch.fx.Graph()))
    return traced


def record_rounds(record: RecordRanks, chosen: Sequence[int], *,
                  stage_ranks: bool) -> tuple[dict[int, ProgramTrace], tuple[str, ...]]:
    """Each rank of ``chosen`` recorded by ``record`` (several at once), until the messages
    between pipeline stages agree (graphmem.trace.program.stage_messages): a rank that waits
    for another's message is recorded again after it (that rank recorded too, if not chosen),
    one whose assumed message a later recording contradicts is recorded again; each round's
    recordings read what the rounds before sent.  ``stage_ranks``: also the first rank of each pipeline
    stage.  Returns the recordings by rank, and why ranks not chosen were recorded ("2, 3: the
    first rank of each pipeline stage"; none: empty).

    Raises:
        TraceError: a round in which no rank ended and no message was sent (the ranks wait for
            each other), or more rounds than four for each rank recorded (the ranks keep
            contradicting each other).
    """
    runs: dict[int, ProgramTrace] = {}
    pending, why = sorted(set(chosen)), dict[int, str]()
    rounds, sent_before, mailbox = 0, -1, Mailbox()
    while True:
        rounds += 1
        waiting = _round(record, pending, mailbox, runs)
        sent = _sent(runs, waiting)
        if not set(pending) - set(waiting) and len(sent) == sent_before or rounds > 4 * (len(runs) + len(waiting)) + 8:
            break
        mailbox, sent_before = Mailbox(sent), len(sent)
        pending = _again(runs, waiting, mailbox, chosen, why, stage_ranks=stage_ranks)
        if not pending:
            return runs, _reasons(why)
    stuck = ", ".join(f"rank {rank}: {waits}" for rank, waits in waiting.items())
    raise TraceError(f"the program's pipeline stages wait for each other's messages ({stuck}); graphmem "
                     "records each rank alone and could not order them")


def _round(record: RecordRanks, pending: list[int], mailbox: Mailbox, runs: dict[int, ProgramTrace]
           ) -> dict[int, Waits]:
    """One round of ``pending``: the ranks that ended go into ``runs``; returns those that wait."""
    waiting: dict[int, Waits] = {}
    for rank, result in zip(pending, record(pending, mailbox), strict=True):
        if isinstance(result, Waits):
            waiting[rank] = result
        else:
            runs[rank] = result
    return waiting


def _sent(runs: dict[int, ProgramTrace], waiting: dict[int, Waits]) -> dict[Key, Any]:
    """Every message the recordings so far sent, those of the ranks that wait included."""
    sent = {key: message for run in runs.values() for key, message in run.exchanged.sent.items()}
    for waits in waiting.values():
        sent.update(waits.sent)
    return sent


def _again(runs: dict[int, ProgramTrace], waiting: dict[int, Waits], mailbox: Mailbox, chosen: Sequence[int],
           why: dict[int, str], *, stage_ranks: bool) -> list[int]:
    """The ranks of the next round: those that wait, those whose assumed messages ``mailbox``
    contradicts (dropped from ``runs``), and the senders waited for and (``stage_ranks``) each
    stage's first rank not yet recorded (why each was added goes into ``why``)."""
    again = {rank for rank, run in runs.items() if mailbox.contradicts(run.exchanged.assumed)}
    for rank in again:
        del runs[rank]
    senders = {w.sender for w in waiting.values() if not mailbox.find(w.key)[0]}
    stages = set(runs[0].exchanged.stages.values()) if stage_ranks and 0 in runs else set()
    for rank in sorted((senders | stages) - set(chosen) - set(why)):
        why[rank] = "the pipeline stages the others wait for" if rank in senders else \
            "each pipeline stage's first rank"
    return sorted(set(waiting) | again | ((senders | stages) - set(runs)))


def _reasons(why: dict[int, str]) -> tuple[str, ...]:
    """``why`` as "RANKS: REASON", one line a reason, in the order the reasons first came."""
    reasons = {reason: [r for r in sorted(why) if why[r] == reason] for reason in dict.fromkeys(why.values())}
    return tuple(f"{', '.join(map(str, ranks))}: {reason}" for reason, ranks in reasons.items())
