"""How fast the command line starts: each command run as a whole process, three times, the
best time kept, against ``python -c "import torch"`` in the same run.

    python benchmarks/bench_startup.py

Targets (issue 28): ``graphmem --help`` and a usage error under 0.5 s; ``import graphmem``
within 0.3 s of ``import torch``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "python -c 'import torch, graphmem'": [sys.executable, "-c", "import torch, graphmem"],
    "python -c 'import torch, graphmem.api'": [sys.executable, "-c", "import torch, graphmem.api"],
    "graphmem --help": [sys.executable, "-m", "graphmem", "--help"],
    "graphmem --version": [sys.executable, "-m", "graphmem", "--version"],
    "graphmem run --help": [sys.executable, "-m", "graphmem", "run", "--help"],
    "graphmem analyze (usage error)": [sys.executable, "-m", "graphmem", "analyze"],
    "graphmem analyze examples/mlp.py:MLP --input 32x1000": [sys.executable, "-m", "graphmem", "analyze",
                                                             "examples/mlp.py:MLP", "--input", "32x1000"],
}


def best_of(command: list[str], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    print(f"{'command':<58} {'seconds':>8}")
    for name, command in CASES.items():
        print(f"{name:<58} {best_of(command):>8.2f}")


if __name__ == "__main__":
    main()
