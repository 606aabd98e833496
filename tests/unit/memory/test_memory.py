"""The memory model on hand-built traces: timelines and breakdowns derived by hand."""

from __future__ import annotations

import torch

from graphmem.memory.liveness import compute_lifetimes
from graphmem.memory.mode_report import build_mode_report, compute_timeline
from graphmem.memory.results import Category
from graphmem.records import OpRecord, Phase, Role, StorageRecord, Trace


def _op(i: int, phase: Phase, scratch: int = 0) -> OpRecord:
    return OpRecord(index=i, op=f"aten.op{i}", phase=phase, iteration=0, module="m",
                    inputs=(), outputs=(), scratch_bytes=scratch)


def _storage(sid: int, nbytes: int, created: int, released: int | None, *roles: Role) -> StorageRecord:
    return StorageRecord(sid=sid, nbytes=nbytes, created=created, released=released,
                         roles=frozenset(roles), label="", shape=(), dtype="float32")


def _trace() -> Trace:
    ops = (_op(0, Phase.FORWARD), _op(1, Phase.FORWARD, scratch=5), _op(2, Phase.LOSS),
           _op(3, Phase.BACKWARD), _op(4, Phase.OPTIMIZER))
    storages = (
        _storage(0, 100, -1, None, Role.PARAMETER),          # live 0..4
        _storage(1, 10, 0, 3, Role.SAVED),                   # saved activation, freed by backward
        _storage(2, 7, 1, 1),                                # temporary, one op
        _storage(3, 100, 3, None, Role.GRADIENT),            # gradient from backward on
        _storage(4, 1, 2, None, Role.OUTPUT),                # the loss
    )
    return Trace(mode="train", fx=torch.fx.Graph(), ops=ops, storages=storages, optimizer="sgd")


def test_timeline_by_hand() -> None:
    trace = _trace()
    # op0: 100+10; op1: 100+10+7+scratch 5; op2: 100+10+1; op3: 100+10+100+1; op4: 100+100+1
    assert compute_timeline(compute_lifetimes(trace), trace) == (110, 122, 111, 211, 201)


def test_report_by_hand() -> None:
    trace = _trace()
    report = build_mode_report(trace, compute_lifetimes(trace))
    assert report.peak_bytes == 211 and report.peak.step == 3 and report.peak.phase == "backward"
    assert report.breakdown[Category.PARAMETER] == 100
    assert report.breakdown[Category.GRADIENT] == 100
    assert report.breakdown[Category.ACTIVATION] == 10
    assert report.breakdown[Category.OUTPUT] == 1
    assert sum(report.breakdown.values()) == report.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.phases} == {
        "forward": 122, "loss": 111, "backward": 211, "optimizer": 201}
    assert report.activations_bytes == 10  # saved and live at the end of the loss phase (op 2)
    assert report.grads_bytes == 100
    assert report.params_bytes == 100
    assert report.unmodeled_ops == tuple(f"aten.op{i}" for i in range(5))


def test_last_use_policy_frees_temporaries_early() -> None:
    ops = (_op(0, Phase.FORWARD), _op(1, Phase.FORWARD), _op(2, Phase.FORWARD))
    ops = (ops[0], OpRecord(1, "aten.op1", Phase.FORWARD, 0, "m", (1,), (2,), 0), ops[2])
    storages = (_storage(1, 10, 0, None), _storage(2, 20, 1, None))
    trace = Trace(mode="inference", fx=torch.fx.Graph(), ops=ops, storages=storages, optimizer=None)
    # observed: both referenced to the end -> 10, 30, 30
    assert compute_timeline(compute_lifetimes(trace), trace) == (10, 30, 30)
    # last use of both is op 1 -> 10, 30, 0
    assert compute_timeline(compute_lifetimes(trace, "last_use"), trace) == (10, 30, 0)


def test_events_replay_to_the_timeline() -> None:
    from graphmem.memory.mode_report import memory_events

    trace = _trace()
    lifetimes = compute_lifetimes(trace)
    events = memory_events(lifetimes, len(trace.ops))
    # by hand: params before op 0; op0 allocs the saved 10; op1 the temporary 7, freed after op1;
    # op2 the loss 1; op3 the gradient 100 and frees the saved 10 after it
    assert [(e.kind, e.nbytes, e.step) for e in events] == [
        ("alloc", 100, -1), ("alloc", 10, 0), ("alloc", 7, 1), ("free", 7, 1), ("alloc", 1, 2),
        ("alloc", 100, 3), ("free", 10, 3)]
