"""What the stages of a pipelined program tell each other, when each rank is recorded alone.

A program that pipelines with ``torch.distributed.pipelining`` and gives its stages no example
shapes lets them work the shapes out at run time: on its first step each stage votes (over
point-to-point messages) whether every stage knows its shapes, then each sends the next stage
the metadata of its outputs and the previous one that of its input gradients.  On the fake
process group nothing arrives, and each rank is recorded in a process of its own.

So the messages are carried between recordings: a ``Mailbox`` holds what the ranks recorded so
far sent, by sender and receiver (and, for a rank whose peers were not recorded, by stage: the
pipelines of a data-parallel job are alike).  A stage receives from it; a message not there
yet is

- from the previous stage (its output shapes): not guessed; the recording stops (``Waits``)
  and is made again once that stage's rank has been recorded;
- from the next stage (the input gradients' shapes): taken as torch takes a gradient's
  metadata from its tensor's, from this stage's outputs, and listed as assumed;
- the vote's outcome, from the last stage: taken as the votes seen so far, listed as assumed.

The caller records the ranks again whose assumptions a later recording contradicts.

Input: the mailbox.  Output: ``Exchange``, then its ``Exchanged`` (what this recording sent, assumed, and the
pipeline's stages by global rank), filled as the program runs.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from graphmem._torch_api import (
    pipeline_backward_meta,
    pipeline_inference_mode,
    pipeline_warmup_owners,
    set_stage_inference_mode,
    stage_peer_rank,
    stage_same_rank,
    stage_user_meta,
)
from graphmem.patching import patched, when_imported

__all__ = ["Exchange", "Exchanged", "Key", "Mailbox", "Waits", "exchanging_stage_messages"]

# (what, sending stage, receiving stage, sending rank, receiving rank, how many sent before on
# that channel): what is "shapes", "vote" (the votes so far) or "outcome" (the vote's)
Key = tuple[str, int, int, int, int, int]


class Waits(BaseException):
    """A stage needs a message from a rank not yet recorded; not an Exception, so the
    program's ``except Exception`` blocks let it through."""

    def __init__(self, key: Key) -> None:
        super().__init__(key)  # (pickled back from a rank's process by its arguments)
        self.key = key
        self.sent: dict[Key, Any] = {}  # what the recording had sent before it stopped

    @property
    def sender(self) -> int:
        """The rank the message would come from."""
        return self.key[3]

    def __str__(self) -> str:
        return f"stage {self.key[2]} waits for a message from stage {self.key[1]} on rank {self.sender}"


@dataclass(frozen=True)
class Mailbox:
    """The messages the ranks recorded so far sent (shapes pickled: the process that orders the
    recordings never imports torch's pipelining, which makes a tensor at import)."""

    sent: Mapping[Key, Any] = field(default_factory=dict)

    def find(self, key: Key) -> tuple[bool, Any]:
        """The message of ``key``: from its sender to its receiver, else (stages alike) from
        any rank of the sending stage to any of the receiving one, on the same channel."""
        if key in self.sent:
            return True, self.sent[key]
        what, src, dst, _, _, seq = key
        for (w, s, d, _, _, n), message in self.sent.items():
            if (w, s, d, n) == (what, src, dst, seq):
                return True, message
        return False, None

    def contradicts(self, assumed: Mapping[Key, Any]) -> bool:
        """Whether a message assumed differs from one sent."""
        for key, guess in assumed.items():
            found, message = self.find(key)
            if found and message != guess:
                return True
        return False


@dataclass(frozen=True)
class Exchanged:
    """What a recording sent and assumed, and the stages of its pipeline (stage -> global rank;
    empty: the program does not pipeline)."""

    sent: Mapping[Key, Any] = field(default_factory=dict)
    assumed: Mapping[Key, Any] = field(default_factory=dict)
    stages: Mapping[int, int] = field(default_factory=dict)


@dataclass
class Exchange:
    """One recording's side: what it may receive, and what it sent and assumed."""

    mailbox: Mailbox = field(default_factory=Mailbox)
    sent: dict[Key, Any] = field(default_factory=dict)
    assumed: dict[Key, Any] = field(default_factory=dict)
    stages: dict[int, int] = field(default_factory=dict)  # stage index -> the global rank that runs it
    _counts: collections.Counter[tuple[str, int, int]] = field(default_factory=collections.Counter)

    def result(self) -> Exchanged:
        return Exchanged(dict(self.sent), dict(self.assumed), dict(self.stages))

    def key(self, what: str, src: int, dst: int, src_rank: int, dst_rank: int) -> Key:
        n = self._counts[(what, src, dst)]
        self._counts[(what, src, dst)] += 1
        return (what, src, dst, src_rank, dst_rank, n)


def _ranks(stage: Any) -> tuple[int, dict[int, int]]:
    """This stage's global rank, and every stage's."""
    peers = {s: stage_peer_rank(stage, s) for s in range(stage.num_stages)}
    return peers[stage.stage_index], peers


@contextlib.contextmanager
def exchanging_stage_messages(exchange: Exchange) -> Iterator[None]:
    """Pipeline stages send into ``exchange`` and receive from its mailbox (see the module
    docstring); nothing changes for a program that does not pipeline.  torch's pipelining is
    changed when the program imports it, not before: it makes a tensor at import, which is the
    program's own (counted in a real run that imports it)."""
    with contextlib.ExitStack() as stack:
        def change(module: ModuleType) -> None:
            stack.enter_context(_stages_exchanging(exchange))

        with when_imported("torch.distributed.pipelining.schedules", change):
            yield


@contextlib.contextmanager
def _stages_exchanging(exchange: Exchange) -> Iterator[None]:
    """The patches of ``exchanging_stage_messages``, torch's pipelining imported."""
    from torch.distributed.pipelining import stage as stages_module
    PipelineStage = stages_module.PipelineStage
    if not all(hasattr(PipelineStage, name) for name in ("_send_meta", "_recv_meta", "_warmup_forward_vote")):
        yield  # an older pipelining that exchanges otherwise: left as it is
        return
    InferenceMode = pipeline_inference_mode()

    def note_stages(stage: Any) -> tuple[int, dict[int, int]]:
        me, peers = _ranks(stage)
        exchange.stages.update(peers)
        return me, peers

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        me, peers = note_stages(self)
        exchange.sent[exchange.key("shapes", self.stage_index, dst_stage, me, peers[dst_stage])] = pickle.dumps(meta)

    def recv_meta(self: Any, src_stage: int) -> Any:
        me, peers = note_stages(self)
        key = exchange.key("shapes", src_stage, self.stage_index, peers[src_stage], me)
        found, meta = exchange.mailbox.find(key)
        if found:
            return pickle.loads(meta)  # (written by graphmem's own recording of a rank)
        if src_stage < self.stage_index:  # the previous stage's outputs: only its recording knows them
            raise Waits(key)
        guess = pipeline_backward_meta(self._stage_meta.outputs)
        exchange.assumed[key] = pickle.dumps(guess)
        return guess

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        if not all(isinstance(stage, PipelineStage) for stage in stages):
            original = next(originals[c] for c in type(self).__mro__ if c in originals)
            return original(self, stages, has_backward, p2p_done)  # type: ignore[no-any-return]
        acc = 1
        for stage in stages:  # the vote, first stage to last: 1 where every stage knows its shapes
            me, peers = note_stages(stage)
            vote = 0 if InferenceMode.needs_dynamic(stage_user_meta(stage), has_backward) else 1
            if not stage.is_first and not stage_same_rank(stage, stage.stage_index - 1):
                prev = stage.stage_index - 1
                key = exchange.key("vote", prev, stage.stage_index, peers[prev], me)
                found, acc = exchange.mailbox.find(key)
                if not found:
                    raise Waits(key)
            acc *= vote
            if not stage.is_last and not stage_same_rank(stage, stage.stage_index + 1):
                nxt = stage.stage_index + 1
                exchange.sent[exchange.key("vote", stage.stage_index, nxt, me, peers[nxt])] = acc
        result = acc
        for stage in reversed(stages):  # its outcome, last stage to first
            me, peers = note_stages(stage)
            if not stage.is_last and not stage_same_rank(stage, stage.stage_index + 1):
                nxt = stage.stage_index + 1
                key = exchange.key("outcome", nxt, stage.stage_index, peers[nxt], me)
                found, message = exchange.mailbox.find(key)
                if found:
                    result = message
                else:
                    exchange.assumed[key] = result
            if not stage.is_first and not stage_same_rank(stage, stage.stage_index - 1):
                prev = stage.stage_index - 1
                exchange.sent[exchange.key("outcome", stage.stage_index, prev, me, peers[prev])] = result
            set_stage_inference_mode(stage, InferenceMode.STATIC if result == 1 else InferenceMode.DYNAMIC)
        return None

    targets = pipeline_warmup_owners()
    originals = {cls: cls.__dict__["_warmup_p2p"] for cls in targets}
    with patched((PipelineStage, "_send_meta", send_meta), (PipelineStage, "_recv_meta", recv_meta),
                 *((cls, "_warmup_p2p", warmup) for cls in targets)):
        yield
