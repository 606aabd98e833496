"""graphmem run on torchtitan's llama3_70b config at 64 ranks (FSDP 8 x tensor parallel 8,
full activation checkpointing, batch 8 x 8192 on H100s): wall seconds and peak RSS of the whole
command, its model's 80 blocks recorded as four (the default) and, with ``--whole``, recorded
whole (GRAPHMEM_REPEATED_BLOCKS=0), which must give the same report byte for byte.

    python benchmarks/bench_run_titan.py [--whole] [--nproc-per-node 64] [--json out.json]

Needs torchtitan 0.3.0 (``pip install 'graphmem[frameworks]'``); the tokenizer and data are
made locally (tests/programs/titan/make_assets.py), nothing is downloaded.  The peak RSS is the
largest of the command's processes (``ru_maxrss`` of its children, as ``/usr/bin/time -v``
reports it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITAN = ROOT / "tests" / "programs" / "titan"
ARGS = ["--module", "tiny_titan", "--config", "llama3_70b_local", "--parallelism.spmd_backend", "partial_dtensor",
        "--training.disable_cuda_graphs"]


def run(assets: str, nproc: int, whole: bool) -> dict[str, object]:
    """One ``graphmem run --format json`` of the 70B config in a process of its own."""
    env = {**os.environ, "TINY_TITAN_ASSETS": assets, "GRAPHMEM_REPEATED_BLOCKS": "0" if whole else "1"}
    code = ("import resource, subprocess, sys, time; start = time.perf_counter(); "
            "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr[-4000:]); "
            "print('\\nBENCH', time.perf_counter() - start, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.returncode, file=sys.stderr)")
    command = [sys.executable, "-m", "graphmem", "run", "--format", "json", "--gpu", "h100-80gb", "--nproc-per-node",
               str(nproc), str(TITAN / "train.py"), *ARGS]
    done = subprocess.run([sys.executable, "-c", code, *command], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    line = [x for x in done.stderr.splitlines() if x.startswith("BENCH ")][-1].split()
    wall, rss_kib, code_ = float(line[1]), int(line[2]), int(line[3])
    if code_:
        raise SystemExit(f"graphmem run failed ({code_}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout[done.stdout.index("{"):])
    return {"recorded": "whole" if whole else "4 of 80 blocks", "wall_s": round(wall, 1),
            "peak_rss_mib": rss_kib // 1024, "reserved_peak_bytes": report["train"]["reserved_peak_bytes"],
            "ops": report["train"]["num_ops"], "report": done.stdout[done.stdout.index("{"):]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=64)
    parser.add_argument("--whole", action="store_true", help="also record the whole model and compare")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as assets:
        subprocess.run([sys.executable, str(TITAN / "make_assets.py"), assets], check=True, capture_output=True)
        start = time.perf_counter()
        rows = [run(assets, args.nproc_per_node, False)]
        if args.whole:
            rows.append(run(assets, args.nproc_per_node, True))
    print(f"graphmem run, llama3_70b, {args.nproc_per_node} ranks (ranks auto: 0 and the last), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - start:.0f} s in all")
    print("| recorded | wall s | peak RSS MiB | ops | reserved peak B |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['recorded']} | {r['wall_s']} | {r['peak_rss_mib']} | {r['ops']} | {r['reserved_peak_bytes']} |")
    if args.whole:
        print("reports byte-identical:", rows[0]["report"] == rows[1]["report"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "report"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
