"""What ``graphmem run`` analyses: a training program and its own arguments.

Input: the script (or ``-m`` module), its argv, the optimizer steps to record, its processes
and which of them to record (``--ranks``).  Output: a frozen ``Program``, checked (the script
exists, at least one step, ranks within the world).  Knows nothing of how it is recorded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphmem.errors import UserInputError
from graphmem.job.sections import Target

__all__ = ["Program", "make_program", "program_ranks"]


@dataclass(frozen=True)
class Program:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS``, recorded for ``steps`` optimizer steps."""

    target: str  # the script's path, or the module's name
    argv: tuple[str, ...] = ()
    module: bool = False  # ``-m``
    steps: int = 2
    nproc_per_node: int = 1  # processes on each node, as torchrun --nproc-per-node starts them
    nnodes: int = 1  # nodes, as torchrun --nnodes
    torchrun: bool = False  # launched by torchrun even with one process (its environment, a process group)
    allow_network: bool = False  # the program may connect to servers (else its connections are refused)
    write_through: tuple[str, ...] = ()  # absolute paths it writes for real (else its writes are its layer's)
    runs_on: Target = field(default_factory=Target)  # the device its "cuda" is: a Job's target section
    # the options of the command that runs it (graphmem run's), named when the program got one
    own_options: frozenset[str] = frozenset()
    # the ranks to record (--ranks); None: auto, rank 0 and the last (and, once rank 0 is
    # recorded, each pipeline stage's first rank)
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.ranks is not None:
            _check_ranks(self.ranks, self.world_size)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def chosen_ranks(self) -> tuple[int, ...]:
        """The ranks to record first: ``ranks``, or rank 0 and the last."""
        return self.ranks if self.ranks is not None else tuple(sorted({0, self.world_size - 1}))

    @property
    def launched(self) -> bool:
        """Started as torchrun starts each process (``--nproc-per-node`` or ``--nnodes`` given,
        or more than one process), not as ``python`` starts the one."""
        return self.torchrun or self.world_size > 1

    @property
    def command(self) -> str:
        launcher = ["python"]
        if self.launched:
            launcher = ["torchrun", *([f"--nnodes {self.nnodes}"] if self.nnodes > 1 else []),
                        f"--nproc-per-node {self.nproc_per_node}"]
        return " ".join([*launcher, *(["-m"] if self.module else []), self.target, *self.argv])

    def rank_environment(self, rank: int) -> dict[str, str]:
        """The variables torchrun sets for global ``rank`` (node ``rank // nproc_per_node``)."""
        node, local = divmod(rank, self.nproc_per_node)
        world, per_node = str(self.world_size), str(self.nproc_per_node)
        return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": per_node,
                "GROUP_RANK": str(node), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": world, "NODE_RANK": str(node),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "graphmem"}


def make_program(target: str, argv: tuple[str, ...] = (), *, module: bool = False, steps: int = 2,
                 nproc_per_node: int | None = None, nnodes: int | None = None,
                 allow_network: bool = False, write_through: tuple[str, ...] = (),
                 ranks: str | Sequence[int] = "auto", runs_on: Target | None = None,
                 own_options: frozenset[str] = frozenset()) -> Program:
    """A checked Program; given ``nproc_per_node`` or ``nnodes`` (even 1), launched as torchrun
    launches it, else as ``python`` runs it; ``ranks``: which to record (program_ranks).

    Raises:
        UserInputError: no such script, fewer than one step or one process, a rank outside
            the world.
    """
    if steps < 1:
        raise UserInputError(f"--steps {steps}: record at least one optimizer step")
    torchrun = nproc_per_node is not None or nnodes is not None
    nproc_per_node, nnodes = 1 if nproc_per_node is None else nproc_per_node, 1 if nnodes is None else nnodes
    if nproc_per_node < 1 or nnodes < 1:
        raise UserInputError(f"--nproc-per-node {nproc_per_node} --nnodes {nnodes}: give at least one process "
                             "on at least one node")
    runnable = os.path.isfile(target) or os.path.isfile(os.path.join(target, "__main__.py"))
    if not module and not runnable:
        what = "a folder without __main__.py" if os.path.isdir(target) else "no such program"
        raise UserInputError(f"{what}: {target!r}; give the path of a Python script (graphmem run train.py ARGS), "
                             "a folder with __main__.py, or a module with -m (graphmem run -m pkg.train ARGS)")
    return Program(target=target, argv=tuple(argv), module=module, steps=steps, nproc_per_node=nproc_per_node,
                   nnodes=nnodes, torchrun=torchrun, allow_network=allow_network,
                   write_through=tuple(os.path.abspath(path) for path in write_through),
                   ranks=program_ranks(ranks, nproc_per_node * nnodes), runs_on=runs_on or Target(),
                   own_options=own_options)


def program_ranks(ranks: str | Sequence[int], world: int) -> tuple[int, ...] | None:
    """The ranks ``--ranks`` names: ``auto`` (None: rank 0 and the last; pipeline stages' first
    ranks are added once rank 0 has been recorded), ``all``, or a list ("0,7").

    Raises:
        UserInputError: text that names no rank (Program checks that each is in the world).
    """
    if ranks == "auto":
        return None
    if ranks == "all":
        return tuple(range(world))
    if isinstance(ranks, str):
        try:
            ranks = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            raise UserInputError(f"--ranks {ranks!r}: expected auto, all or ranks such as 0,7") from None
    _check_ranks(ranks, world)
    return tuple(sorted(set(ranks)))


def _check_ranks(ranks: Sequence[int], world: int) -> None:
    """Raise UserInputError unless ``ranks`` names at least one rank, each in the world."""
    outside = [r for r in ranks if not 0 <= r < world]
    if not ranks or outside:
        raise UserInputError(f"--ranks: {', '.join(map(str, outside)) or 'none given'}; the ranks are 0 to {world - 1}")
