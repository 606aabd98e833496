"""Benchmark graphmem against PyTorch's MemTracker on the 6.7B GPT training step.

Both tools predict the peak memory of two training iterations (forward, loss =
logits.sum(), backward, AdamW step, zero_grad(set_to_none=True)) of
``examples/gpt.py:gpt_6_7b`` on a 1x4096 int64 batch, without allocating real weights:

* graphmem: ``graphmem.analyze(..., mode="train", optimizer="adamw")``;
* MemTracker: ``torch.distributed._tools.MemTracker`` run under ``FakeTensorMode``.

Each tool runs in its own fresh subprocess, one after the other (never in parallel),
and reports its wall seconds (the analysis alone, imports excluded; ``process_s`` in
the JSON is the whole child process), its peak RSS (MiB, from ``getrusage`` in the child) and
the peak it predicts (GiB). Run it with::

    python benchmarks/bench_gpt_6_7b.py                    # full 6.7B config
    python benchmarks/bench_gpt_6_7b.py --quick            # small config, smoke run
    python benchmarks/bench_gpt_6_7b.py --json out.json    # also write the numbers
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
GIB = 1024**3

FULL = {"config": dict(vocab=32000, dim=4096, layers=32, heads=32, max_seq=4096), "batch": 1, "seq": 4096}
QUICK = {"config": dict(vocab=32000, dim=1024, layers=4, heads=16, max_seq=1024), "batch": 1, "seq": 1024}
TOOLS = ("graphmem", "memtracker")


def _setup(quick: bool) -> dict[str, Any]:
    """The model setting for this run; puts examples/ on sys.path."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return QUICK if quick else FULL


def run_graphmem(quick: bool) -> dict[str, Any]:
    """Analyse the training step with graphmem; return its predicted peak and op count."""
    setup = _setup(quick)
    from gpt import GPT

    import graphmem

    target: Any = functools.partial(GPT, **setup["config"]) if quick else "examples/gpt.py:gpt_6_7b"
    spec = f"{setup['batch']}x{setup['seq']}:int64"
    report = graphmem.analyze(target, [spec], mode="train", optimizer="adamw")
    return {"peak_bytes": report.train.peak_bytes, "num_ops": report.train.num_ops}


def _train_step(model: Any, optimizer: Any, ids: Any) -> None:
    """One iteration, as graphmem runs it: logits stay alive through backward (a local)."""
    logits = model(ids)
    loss = logits.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_memtracker(quick: bool) -> dict[str, Any]:
    """Run two fake training iterations under MemTracker; return its total peak across devices."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    setup = _setup(quick)
    from gpt import GPT

    with FakeTensorMode():
        model = GPT(**setup["config"])
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, setup["config"]["vocab"], (setup["batch"], setup["seq"]))
        tracker = MemTracker()
        tracker.track_external(model, optimizer, ids)
        with tracker as mt:
            for _ in range(2):
                _train_step(model, optimizer, ids)
                # MemTracker raises NotImplementedError on a module's second forward unless
                # its per-module stats are cleared; this keeps the global peak it tracks.
                mt.reset_mod_stats()
        peak = mt.get_tracker_snapshot("peak")
    by_device = {str(dev): snap["Total"] for dev, snap in peak.items()}
    return {"peak_bytes": sum(by_device.values()), "peak_by_device": by_device}


WORKERS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "graphmem": run_graphmem,
    "memtracker": run_memtracker,
}


def _preimport(tool: str, quick: bool) -> None:
    """Import torch, the tool and the model module up front, so wall_s times only the analysis."""
    _setup(quick)
    import gpt  # noqa: F401
    import torch

    if tool == "graphmem":
        import graphmem  # noqa: F401
    else:
        import torch.distributed._tools.mem_tracker  # noqa: F401


def worker(tool: str, quick: bool) -> None:
    """Child side: run one tool, then print one JSON line with its timing, RSS and result."""
    _preimport(tool, quick)
    start = time.perf_counter()
    try:
        result: dict[str, Any] = WORKERS[tool](quick)
    except Exception as exc:  # report any failure of the tool instead of crashing
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["wall_s"] = time.perf_counter() - start
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps(result))


def spawn(tool: str, quick: bool) -> dict[str, Any]:
    """Parent side: run one tool in a fresh interpreter and parse its JSON line."""
    start = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", tool] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"child exited {proc.returncode}: " + " | ".join(tail)}
    return {"tool": tool, **json.loads(lines[-1]), "process_s": time.perf_counter() - start}


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table: tool, wall s, peak RSS MiB, predicted peak GiB (or the error)."""
    rows = ["| tool | wall s | peak RSS MiB | predicted peak GiB |", "|---|---:|---:|---:|"]
    for r in results:
        peak = r.get("peak_bytes")
        predicted = r["error"] if "error" in r else _fmt(peak / GIB if peak is not None else None, 3)
        rows.append(f"| {r['tool']} | {_fmt(r.get('wall_s'), 2)} | "
                    f"{_fmt(r.get('peak_rss_mib'), 0)} | {predicted} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small GPT (dim 1024, 4 layers, seq 1024)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick)
        return 0
    results = []
    for tool in TOOLS:  # sequentially: one child at a time
        result = spawn(tool, args.quick)
        result["tool"] = tool
        results.append(result)
    print(f"config: {'quick' if args.quick else 'gpt_6_7b'} {QUICK if args.quick else FULL}\n")
    print(table(results))
    if args.json:
        payload = {"config": "quick" if args.quick else "gpt_6_7b", "python": sys.version.split()[0],
                   "results": [{k: v for k, v in r.items() if k != "traceback"} for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
