"""Speed of the analysis at LLM scale (issue 7): wall seconds and peak RSS, each in a fresh process.

- llama-3-8b training at 4096 tokens, bf16 weights, AdamW, labels in (output.loss);
- llama-3-70b inference with an 8k-token KV cache (prefill 8192 tokens, one decode step);
- llama-3-70b training at 8192 tokens on one GPU (repeated blocks recorded once, and every block
  recorded: GRAPHMEM_REPEATED_BLOCKS=0), and the llama-3.1-405b shape likewise;
- llama-3-70b training at 8192 tokens per GPU with FSDP2 over 64 GPUs, and FSDP2 over 8 x tensor
  parallel over 8 (one rank recorded per group of ranks whose memory is the same).

    python benchmarks/bench_llm.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "llama-3-8b train 1x4096 bf16 adamw": dict(
        preset="llama-3-8b", inputs=["input_ids=1x4096:int64", "labels=1x4096:int64"], mode="train",
        optimizer="adamw"),
    "llama-3-70b generate 8192+1": dict(preset="llama-3-70b", inputs=[], generate="8192+1"),
    "llama-3-70b train 1x8192 adamw": dict(
        preset="llama-3-70b", inputs=["input_ids=1x8192:int64"], mode="train", optimizer="adamw"),
    "llama-3-70b train 1x8192 adamw, every block recorded": dict(
        preset="llama-3-70b", inputs=["input_ids=1x8192:int64"], mode="train", optimizer="adamw",
        env={"GRAPHMEM_REPEATED_BLOCKS": "0"}),
    "llama-3.1-405b train 1x8192 adamw": dict(
        preset="llama-3.1-405b", inputs=["input_ids=1x8192:int64"], mode="train", optimizer="adamw"),
    "llama-3-70b train 1x8192 adamw fsdp=64": dict(
        preset="llama-3-70b", inputs=["input_ids=1x8192:int64"], mode="train", optimizer="adamw",
        parallel="fsdp=64"),
    "llama-3-70b train 1x8192 adamw fsdp=8,tp=8": dict(
        preset="llama-3-70b", inputs=["input_ids=1x8192:int64"], mode="train", optimizer="adamw",
        parallel="fsdp=8,tp=8"),
}

CHILD = """
import json, resource, sys, time
import graphmem
case = json.loads(sys.argv[1])
start = time.perf_counter()
report = graphmem.analyze(None, case.pop("inputs"), **case)
wall = time.perf_counter() - start
peak = report.generate.decode_peak_bytes if report.generate else report.train.peak_bytes
print(json.dumps({"wall_s": round(wall, 2), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                  "predicted_peak_gib": round(peak / 2**30, 2)}))
"""


def run(case: dict[str, Any]) -> dict[str, Any]:
    """One analysis in a fresh interpreter (so its RSS is its own)."""
    env = {**os.environ, **case.pop("env", {})}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    results = {name: run(dict(case)) for name, case in CASES.items()}
    print("| case | wall s | peak RSS MiB | predicted peak GiB |\n|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r.get('wall_s', '-')} | {r.get('rss_mib', '-')} | "
              f"{r.get('predicted_peak_gib', r.get('error'))} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
