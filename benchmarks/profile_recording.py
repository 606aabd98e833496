"""Where the time of one analysis goes: a cProfile of a GPT training step (8 layers, hidden 256,
AdamW, two iterations), recorded with numbers and with the batch as a size symbol, its own
time grouped by where the code lives.

    python benchmarks/profile_recording.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from gpt import GPT

import graphmem

# (label, path fragment): the first match names a function's own time
GROUPS = (
    ("FakeTensor dispatch and meta kernels", ("_subclasses/", "_meta_registrations", "_prims", "_refs/", "_decomp/")),
    ("size symbols (ShapeEnv, sympy)", ("symbolic_shapes", "sym_node", "sympy/", "_sympy/", "fx/experimental")),
    ("graphmem recorder and rules", ("graphmem/trace/",)),
    ("graphmem liveness, memory model, report", ("graphmem/memory/", "graphmem/cuda/", "graphmem/api")),
    ("autograd engine and optimizer (torch)", ("autograd/", "optim/", "_tensor.py")),
    ("dispatch modes and pytree", ("_python_dispatch", "_pytree", "_ops.py", "overrides.py")),
    ("torch.fx graph building", ("fx/graph", "fx/node", "fx/proxy")),
)


OTHER = "builtins and torch C++ (the dispatcher, isinstance, ...)"


def build() -> GPT:
    return GPT(vocab=1000, dim=256, layers=8, heads=8, max_seq=512)


def profile(label: str, run: object) -> None:
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(run)  # type: ignore[arg-type]
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    by_group: dict[str, float] = {}
    for (path, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        group = next((name for name, parts in GROUPS if any(p in path for p in parts)), OTHER)
        by_group[group] = by_group.get(group, 0.0) + own
    total = sum(by_group.values())
    print(f"\n{label}: {wall:.2f} s wall under the profiler\n\n| where | own time s | share |\n|---|---:|---:|")
    for name, own in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {own:.2f} | {own / total:.0%} |")


def main() -> None:
    graphmem.analyze(build, ["4x128:int64"], mode="train", loss="cross_entropy", optimizer="adamw")  # warm up
    profile("recorded with numbers (batch 4)", lambda: graphmem.analyze(
        build, ["4x128:int64"], mode="train", loss="cross_entropy", optimizer="adamw"))
    profile("recorded with the batch as a size symbol (hint 4)", lambda: graphmem.analyze_curve(
        build, ["Bx128:int64"], hint=4, mode="train", loss="cross_entropy", optimizer="adamw"))


if __name__ == "__main__":
    main()
