"""Speed of the pre-flight commands on Llama-3-8B (issue 15), each in a fresh process, side by side:

- max-batch, training at 4096 tokens (bf16, AdamW) against a budget deep enough for a real
  search: with the batch as a size symbol (two recordings) and with one recording per value
  tried (GRAPHMEM_SIZE_SYMBOLS=0, the search as it was);
- analyze --sweep over 7 sequence lengths on an H100 (one recording);
- plan for 2x4096 tokens on an H100: the independent rows in one worker process per core
  (the default) and one after another (GRAPHMEM_PROCESSES=1);
- analyze --parallel zero1=8 (5 distinct ranks): the ranks forked at the first optimizer step
  (the default) and each recorded from the start (GRAPHMEM_FORK_RANKS=0, one per core).

    python benchmarks/bench_preflight.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

LLAMA = ["--preset", "llama-3-8b", "--mode", "train", "--optimizer", "adamw"]
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "max-batch, batch as a symbol": (["max-batch", *LLAMA, "--input", "input_ids=Bx4096:int64", "--budget", "640GB",
                                      "--format", "json"], {}),
    "max-batch, one recording per value": (["max-batch", *LLAMA, "--input", "input_ids=Bx4096:int64", "--budget",
                                            "640GB", "--format", "json"], {"GRAPHMEM_SIZE_SYMBOLS": "0"}),
    "analyze --sweep S=512..8192 (7 values)": (
        ["analyze", *LLAMA, "--input", "input_ids=1xS:int64", "--sweep", "S=512,1024,2048,3072,4096,6144,8192",
         "--device", "cuda", "--gpu", "h100-80gb", "--format", "json"], {}),
    "plan, worker processes": (["plan", *LLAMA, "--input", "input_ids=2x4096:int64", "--device", "cuda", "--gpu",
                                "h100-80gb", "--format", "json"], {}),
    "plan, one after another": (["plan", *LLAMA, "--input", "input_ids=2x4096:int64", "--device", "cuda", "--gpu",
                                 "h100-80gb", "--format", "json"], {"GRAPHMEM_PROCESSES": "1"}),
    "zero1=8 ranks forked": (["analyze", *LLAMA, "--input", "input_ids=2x4096:int64", "--device", "cuda", "--gpu",
                              "h100-80gb", "--parallel", "zero1=8", "--format", "json"], {}),
    "zero1=8 ranks each from the start": (["analyze", *LLAMA, "--input", "input_ids=2x4096:int64", "--device",
                                           "cuda", "--gpu", "h100-80gb", "--parallel", "zero1=8", "--format",
                                           "json"], {"GRAPHMEM_FORK_RANKS": "0"}),
}


def run(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One command in a fresh process: wall seconds, and what it says about recordings."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "graphmem", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    wall = time.perf_counter() - start
    out: dict[str, Any] = {"wall_s": round(wall, 1), "exit": done.returncode}
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {**out, "error": done.stderr.strip().splitlines()[-1:]}
    if "recorded" in data:
        out["recorded"] = data["recorded"]
    if "max_batch" in data:
        out["answer"] = data["max_batch"]
    if "rows" in data:
        out["rows"] = len(data["rows"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--only", help="case names, separated by '|'")
    args = parser.parse_args()
    chosen = {k: v for k, v in CASES.items() if not args.only or k in args.only.split("|")}
    results = {name: run(*case) for name, case in chosen.items()}
    print("| case | wall s | exit | recordings | answer / rows |\n|---|---:|---:|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall_s']} | {r['exit']} | {r.get('recorded', '-')} | "
              f"{r.get('answer', r.get('rows', r.get('error', '-')))} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
