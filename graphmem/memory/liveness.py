"""Stage 3a: liveness.  Trace -> one Lifetime per storage (pure).

Storage-aware: views, in-place results and tied weights share one storage and are counted
once, because the trace keys everything by storage.  A storage is live from the op that
creates it (or from the start, for parameters, buffers and inputs) until it is released.

Release policies:
  - ``"observed"`` (default): the op after which the step really dropped its last
    reference, as recorded while it ran: Python locals, autograd's saved tensors (freed by
    the backward op that consumes them), gradients until ``zero_grad``, optimizer state.
    This is what a real execution allocates.
  - ``"last_use"``: storages with no persistent role die right after their last use in the
    graph; a lower bound, what a compiler that frees eagerly would need.
"""

from __future__ import annotations

from graphmem.memory.results import Category, Lifetime
from graphmem.records import Role, StorageRecord, Trace

__all__ = ["compute_lifetimes", "categorize", "POLICIES"]

POLICIES = ("observed", "last_use")

# A storage with several roles is reported under the first that applies.
_PRIORITY: tuple[tuple[Role, Category], ...] = (
    (Role.PARAMETER, Category.PARAMETER),
    (Role.BUFFER, Category.BUFFER),
    (Role.INPUT, Category.INPUT),
    (Role.GRADIENT, Category.GRADIENT),
    (Role.OPTIMIZER_STATE, Category.OPTIMIZER_STATE),
    (Role.COMMUNICATION, Category.COMMUNICATION),
    (Role.SAVED, Category.ACTIVATION),
    (Role.OUTPUT, Category.OUTPUT),
)
_PERSISTENT = frozenset({Role.PARAMETER, Role.BUFFER, Role.INPUT, Role.GRADIENT,
                         Role.OPTIMIZER_STATE, Role.OUTPUT})


def categorize(storage: StorageRecord) -> Category:
    """The category a storage's bytes are reported under (temporaries when no role)."""
    for role, category in _PRIORITY:
        if role in storage.roles:
            return category
    return Category.TEMPORARY


def compute_lifetimes(trace: Trace, policy: str = "observed") -> tuple[Lifetime, ...]:
    """One Lifetime per storage of ``trace``.

    Args:
        trace: stage 2's output.
        policy: ``"observed"`` or ``"last_use"`` (see the module docstring).

    Returns:
        Lifetimes with inclusive op-index bounds; ``end`` is the last op index for storages
        still referenced when the step ends.
    """
    if policy not in POLICIES:
        raise ValueError(f"compute_lifetimes: unknown policy {policy!r}; expected {POLICIES}")
    last_step = len(trace.ops) - 1
    last_use = _last_uses(trace) if policy == "last_use" else {}
    lifetimes = []
    for s in trace.storages:
        end = last_step if s.released is None else s.released
        if policy == "last_use" and not (s.roles & _PERSISTENT):
            end = min(end, last_use.get(s.sid, s.created))
        lifetimes.append(Lifetime(sid=s.sid, nbytes=s.nbytes, start=s.created,
                                  end=max(end, s.created), category=categorize(s)))
    return tuple(lifetimes)


def _last_uses(trace: Trace) -> dict[int, int]:
    # walk the ops in reverse: the first time a storage is met is its last use
    last: dict[int, int] = {}
    for op in reversed(trace.ops):
        for sid in (*op.inputs, *op.outputs):
            last.setdefault(sid, op.index)
    return last
