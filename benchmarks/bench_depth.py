"""Recording cost against depth: a training step (AdamW, 2 iterations) of N tiny Linear layers,
wall seconds per N, each in a fresh process, with storage releases found through tensors'
weak-reference callbacks (the default) and, for comparison, by checking every live storage
after every op (GRAPHMEM_CHECK_EVERY_STORAGE=1, what graphmem did before).

    python benchmarks/bench_depth.py [--layers 500,1000,2000] [--compare 500,1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, resource, sys, time
import torch
from torch import nn
import graphmem
n = int(sys.argv[1])
model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
start = time.perf_counter()
report = graphmem.analyze(model, [torch.empty(4, 8, device="meta")], mode="train", optimizer="adamw")
print(json.dumps({"wall_s": round(time.perf_counter() - start, 2), "ops": len(report.train.trace.ops),
                  "peak_bytes": report.train.peak_bytes,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def run(layers: int, check_all: bool) -> dict[str, object]:
    env = {**os.environ, "GRAPHMEM_CHECK_EVERY_STORAGE": "1" if check_all else "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(layers)], env=env, capture_output=True, text=True,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), layers=layers,
                checks="every live storage" if check_all else "flagged storages")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="500,1000,2000")
    parser.add_argument("--compare", default="500,1000", help="depths also run checking every storage")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [run(int(n), False) for n in args.layers.split(",")]
    rows += [run(int(n), True) for n in args.compare.split(",") if n]
    print("| layers | ops recorded | release checks | wall s | peak RSS MiB | predicted peak B |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layers']} | {r['ops']} | {r['checks']} | {r['wall_s']} | {r['rss_mib']} | {r['peak_bytes']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
