"""The messages between pipeline stages, carried between ranks recorded each alone: the
mailbox's lookups, and the order in which graphmem run records the ranks until the messages
agree (on stand-in recordings: no program runs)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import pytest

from graphmem.errors import TraceError
from graphmem.trace.program.launch import record_rounds
from graphmem.trace.program.run import ProgramTrace
from graphmem.trace.program.stage_messages import Exchanged, Mailbox, Waits


def test_a_message_is_found_from_its_sender_or_from_the_same_stage_of_another_pipeline() -> None:
    mine = ("shapes", 0, 1, 0, 2, 0)  # stage 0 on rank 0 -> stage 1 on rank 2, the first message
    other = ("shapes", 0, 1, 1, 3, 0)  # the same stages of the pipeline of ranks 1 and 3
    box = Mailbox({mine: b"a", other: b"b"})
    assert box.find(mine) == (True, b"a") and box.find(other) == (True, b"b")
    assert box.find(("shapes", 0, 1, 5, 7, 0)) == (True, b"a")  # a pipeline not recorded: by stage
    assert box.find(("shapes", 0, 1, 0, 2, 1)) == (False, None)  # a second message: none sent yet
    assert box.find(("vote", 0, 1, 0, 2, 0)) == (False, None)


def test_an_assumption_is_contradicted_only_by_a_different_message() -> None:
    key = ("outcome", 1, 0, 2, 0, 0)
    assert not Mailbox({}).contradicts({key: 1})
    assert not Mailbox({key: 1}).contradicts({key: 1})
    assert Mailbox({key: 0}).contradicts({key: 1})


def test_waits_is_no_exception_the_program_catches_and_pickles_back() -> None:
    waits = Waits(("shapes", 0, 1, 0, 1, 0))
    waits.sent = {("vote", 0, 1, 0, 1, 0): 1}
    assert not isinstance(waits, Exception)
    back = pickle.loads(pickle.dumps(waits))
    assert (back.key, back.sender, back.sent) == (waits.key, 0, waits.sent)
    assert "stage 1 waits for a message from stage 0 on rank 0" in str(back)


class _Chain:
    """Stand-in recordings of a pipeline of ``stages`` stages, one per rank, ``replicas`` alike
    pipelines (rank = stage * replicas + replica): a stage past the first waits for the
    previous stage's shapes; the first assumes the vote's outcome, which the last sends."""

    def __init__(self, stages: int, replicas: int = 1, outcome: int = 0) -> None:
        self.stages, self.replicas, self.outcome = stages, replicas, outcome
        self.box = Mailbox()
        self.rounds: list[list[int]] = []

    def record(self, ranks: Sequence[int], mailbox: Mailbox) -> list[Any]:
        self.rounds.append(list(ranks))
        self.box = mailbox
        return [self._one(rank) for rank in ranks]

    def _one(self, rank: int) -> Any:
        stage, replica = divmod(rank, self.replicas)
        peer = lambda s: s * self.replicas + replica
        sent: dict[Any, Any] = {}
        assumed: dict[Any, Any] = {}
        if stage > 0:
            key = ("shapes", stage - 1, stage, peer(stage - 1), rank, 0)
            if not self.box.find(key)[0]:
                return Waits(key)
        if stage < self.stages - 1:
            sent[("shapes", stage, stage + 1, rank, peer(stage + 1), 0)] = b"meta"
            found, outcome = self.box.find(("outcome", stage + 1, stage, peer(stage + 1), rank, 0))
            if not found:
                assumed[("outcome", stage + 1, stage, peer(stage + 1), rank, 0)] = 1
        if stage > 0:
            sent[("outcome", stage, stage - 1, rank, peer(stage - 1), 0)] = self.outcome
        return ProgramTrace(trace=None, steps=1, stopped=True, models=("Stage",), optimizers=(),  # type: ignore[arg-type]
                            exchanged=Exchanged(sent, assumed, {s: peer(s) for s in range(self.stages)}))


def test_ranks_are_recorded_again_until_every_stage_has_what_it_waited_for() -> None:
    chain = _Chain(stages=3)
    runs, why = record_rounds(chain.record, [0, 2], stage_ranks=False)
    assert sorted(runs) == [0, 1, 2]
    # 2 waits for stage 1, so 1 is recorded (2 still waits: 1 was recorded beside it); 1 sends
    # an outcome 0 assumed otherwise, so 0 again, with 2; 2's outcome contradicts 1's: 1 again
    assert chain.rounds == [[0, 2], [1, 2], [0, 2], [1]] and why == ("1: the pipeline stages the others wait for",)


def test_auto_adds_each_stages_first_rank_and_answers_a_replica_by_stage() -> None:
    chain = _Chain(stages=2, replicas=2, outcome=1)  # ranks 0, 1: stage 0; 2, 3: stage 1
    runs, why = record_rounds(chain.record, [0, 3], stage_ranks=True)
    assert sorted(runs) == [0, 2, 3] and why == ("2: each pipeline stage's first rank",)
    assert chain.rounds == [[0, 3], [2, 3]]  # rank 3's stage-0 peer (rank 1) is never recorded


def test_ranks_that_never_stop_waiting_are_one_clear_error() -> None:
    class Stuck(_Chain):
        def _one(self, rank: int) -> Any:
            return Waits(("shapes", 1 - rank, rank, 1 - rank, rank, 0))

    chain = Stuck(stages=2)
    with pytest.raises(TraceError, match="wait for each other"):
        record_rounds(chain.record, [0, 1], stage_ranks=False)
