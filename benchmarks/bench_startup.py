"""How fast the command line starts, and what a whole run costs: each command run as a whole
process, ``--runs`` times (round robin, so that a busy machine slows every row alike), the best
time kept, against ``python -c "import torch"`` in the same run.

    python benchmarks/bench_startup.py            # every row, 3 runs each (about 3 minutes)
    python benchmarks/bench_startup.py --no-gpt   # without the two 6.7B GPT rows

Targets (issue 28), printed with pass/fail: ``graphmem --help``, each command's ``--help`` and a
usage error under 0.5 s; ``import torch, graphmem`` and ``import torch, graphmem.api`` within
0.3 s of ``import torch``; the 6.7B GPT training step end to end (``graphmem analyze``, the
step benchmarks/bench_gpt_6_7b.py times) at most 0.2x PyTorch's MemTracker under FakeTensorMode
on the same step, also a whole process (bench_gpt_6_7b.py's own MemTracker worker).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPHMEM = [sys.executable, "-m", "graphmem"]
TORCH = "python -c 'import torch'"
WITH_GRAPHMEM = "python -c 'import torch, graphmem'"
WITH_API = "python -c 'import torch, graphmem.api'"
HELPS = [f"graphmem {name} --help" for name in ("analyze", "check", "max-batch", "max-seq", "plan", "run")]
USAGE_ERRORS = ["graphmem analyze (usage error: nothing to analyse)", "graphmem analyze --mode bogus",
                "graphmem check examples/mlp.py:MLP -i 3xq"]
GPT = "graphmem analyze examples/gpt.py:gpt_6_7b (6.7B step)"
MEMTRACKER = "MemTracker + FakeTensorMode (6.7B step)"

# name -> (command, the exit code it must end with)
CASES: dict[str, tuple[list[str], int]] = {
    TORCH: ([sys.executable, "-c", "import torch"], 0),
    WITH_GRAPHMEM: ([sys.executable, "-c", "import torch, graphmem"], 0),
    WITH_API: ([sys.executable, "-c", "import torch, graphmem.api"], 0),
    "graphmem --help": ([*GRAPHMEM, "--help"], 0),
    "graphmem --version": ([*GRAPHMEM, "--version"], 0),
    **{name: ([*GRAPHMEM, *name.split()[1:]], 0) for name in HELPS},
    USAGE_ERRORS[0]: ([*GRAPHMEM, "analyze"], 2),
    USAGE_ERRORS[1]: ([*GRAPHMEM, "analyze", "--mode", "bogus"], 2),
    USAGE_ERRORS[2]: ([*GRAPHMEM, "check", "examples/mlp.py:MLP", "-i", "3xq"], 2),
    "graphmem analyze examples/mlp.py:MLP --input 32x1000": (
        [*GRAPHMEM, "analyze", "examples/mlp.py:MLP", "--input", "32x1000"], 0),
    GPT: ([*GRAPHMEM, "analyze", "examples/gpt.py:gpt_6_7b", "--input", "1x4096:int64", "--mode", "train",
           "--optimizer", "adamw"], 0),
    MEMTRACKER: ([sys.executable, "benchmarks/bench_gpt_6_7b.py", "--worker", "memtracker"], 0),
}

Times = dict[str, float]
# (what, whether the times meet it, the numbers it compares)
TARGETS: list[tuple[str, Callable[[Times], bool], Callable[[Times], str]]] = [
    ("graphmem --help under 0.5 s", lambda t: t["graphmem --help"] < 0.5, lambda t: f"{t['graphmem --help']:.2f} s"),
    ("each command's --help under 0.5 s", lambda t: max(t[n] for n in HELPS) < 0.5,
     lambda t: f"slowest {max(t[n] for n in HELPS):.2f} s"),
    ("a usage error under 0.5 s", lambda t: max(t[n] for n in USAGE_ERRORS) < 0.5,
     lambda t: f"slowest {max(t[n] for n in USAGE_ERRORS):.2f} s"),
    ("import torch, graphmem within 0.3 s of import torch", lambda t: t[WITH_GRAPHMEM] - t[TORCH] <= 0.3,
     lambda t: f"{t[WITH_GRAPHMEM] - t[TORCH]:+.2f} s"),
    ("import torch, graphmem.api within 0.3 s of import torch", lambda t: t[WITH_API] - t[TORCH] <= 0.3,
     lambda t: f"{t[WITH_API] - t[TORCH]:+.2f} s"),
    ("6.7B GPT step end to end at most 0.2x MemTracker+FakeTensorMode", lambda t: t[GPT] / t[MEMTRACKER] <= 0.2,
     lambda t: f"{t[GPT] / t[MEMTRACKER]:.2f}x ({t[GPT]:.1f} s / {t[MEMTRACKER]:.1f} s)"),
]


def timed(command: list[str], code: int) -> float:
    """Seconds ``command`` takes as a whole process; it must exit with ``code``."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != code:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}, not {code}:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each command; the best is kept")
    parser.add_argument("--no-gpt", action="store_true", help="leave out the two 6.7B GPT rows (minutes)")
    options = parser.parse_args()
    cases = {name: case for name, case in CASES.items() if not (options.no_gpt and name in (GPT, MEMTRACKER))}
    best: Times = {}
    for _ in range(options.runs):
        for name, (command, code) in cases.items():
            best[name] = min(best.get(name, float("inf")), timed(command, code))
    print(f"{'command (whole process, best of ' + str(options.runs) + ')':<62} {'seconds':>8}")
    for name, seconds in best.items():
        print(f"{name:<62} {seconds:>8.2f}")
    print(f"\n{'target':<66} result")
    for what, met, numbers in TARGETS:
        try:
            print(f"{what:<66} {'pass' if met(best) else 'FAIL'}  {numbers(best)}")
        except KeyError:  # a row left out (--no-gpt)
            print(f"{what:<66} -     not run")


if __name__ == "__main__":
    main()
