"""Repeated blocks recorded once, against recording every block, over transformers' architectures.

Every model type of the installed transformers (or those given with --only) is built from its
small config (benchmarks/coverage.py) with its layer counts raised to LAYERS, then analysed twice
in one subprocess, inference and one SGD training step each: with repeated blocks recorded once
(graphmem's default) and with every block recorded (GRAPHMEM_REPEATED_BLOCKS=0).  A row says
whether the stack was placed by offset and, if it was, whether the two reports are the same: the
trace op for op and storage for storage, the fx graph node for node, and every number of the
report.  Where the whole model was recorded it says why.

    python benchmarks/repeated_blocks.py --only llama,gpt2,bert          # a few, printed
    python benchmarks/repeated_blocks.py --jobs 2 --write docs/repeated-blocks.md
    python benchmarks/repeated_blocks.py --every 3 --write docs/repeated-blocks.md   # a third of them
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
LAYERS = 7
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers")


def deep_config(model_type: str) -> Any:
    """The small config with every layer count at LAYERS (per-layer lists cycled to match)."""
    from coverage import small_config

    config = small_config(model_type)
    for key in _LAYER_KEYS:
        if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool):
            setattr(config, key, LAYERS)
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and value and key.endswith(("layer_types", "_layers_block_type", "block_types")):
            setattr(config, key, [value[i % len(value)] for i in range(LAYERS)])
    return config


def _same(a: Any, b: Any) -> str:
    """"" when two ModeReports are the same in every respect, else what differs."""
    import torch

    from graphmem.trace.repeat.place import same_trace

    def graph(trace: Any) -> list[tuple[str, ...]]:
        return [(n.name, n.op, str(n.target), str(torch.fx.node.map_arg((n.args, n.kwargs), lambda x: x.name)))
                for n in trace.graph.nodes]
    if not same_trace(a.trace, b.trace):
        return "trace"
    if graph(a.trace) != graph(b.trace):
        return "graph"
    return "" if replace(a, trace=None) == replace(b, trace=None) else "report"


def _analysis(build: Any, mode: str, specs: list[str], flag: str) -> tuple[Any, float]:
    from coverage import _clear_caches

    import graphmem

    _clear_caches()  # a tensor model code cached by shape in one analysis must not reach the other
    os.environ["GRAPHMEM_REPEATED_BLOCKS"] = flag
    start = time.perf_counter()
    keywords: dict[str, Any] = dict(mode="inference") if mode == "inference" else \
        dict(mode="train", optimizer="sgd", loss="auto")
    report = graphmem.analyze(build, specs, **keywords)
    return (report.inference if mode == "inference" else report.train), time.perf_counter() - start


def worker(model_type: str) -> None:
    """One architecture: a JSON line per mode."""
    import copy

    from coverage import candidate_classes, first_buildable, input_variants

    import graphmem.trace.repeat as record

    why: list[str] = []
    placed: list[int] = []
    find, repeat = record.find_stack, record.repeat_blocks

    def found(model: Any) -> Any:
        stack = find(model)
        if stack is None:
            why.append(f"no stack of {6}+ alike blocks")
        return stack

    def spied(trace: Any, prefix: str, length: int, **kw: Any) -> Any:
        try:
            out = repeat(trace, prefix, length, **kw)
        except Exception as error:
            why.append(f"{prefix}: {error}")
            raise
        if length != 4:
            placed.append(length)
        return out
    record.find_stack, record.repeat_blocks = found, spied
    try:
        config = deep_config(model_type)
        cls, task, _ = first_buildable(config, candidate_classes(model_type))
    except Exception as error:
        print(json.dumps(dict(type=model_type, mode="build", status="not built", error=str(error)[:200])), flush=True)
        return
    build = lambda: cls(copy.deepcopy(config))
    for mode in ("inference", "train"):
        row: dict[str, Any] = dict(type=model_type, mode=mode, cls=cls.__name__)
        for inputs in input_variants(cls, config, task, mode):
            specs = [i.spec for i in inputs]
            try:
                whole, whole_s = _analysis(build, mode, specs, "0")
            except Exception as error:
                row |= dict(status="not analysed", error=f"{type(error).__name__}: {str(error)[:160]}")
                continue
            why.clear(), placed.clear()
            fast, fast_s = _analysis(build, mode, specs, "1")
            differs = _same(fast, whole)
            status = ("DIFFERENT: " + differs if differs else "identical") if placed else "recorded whole"
            row |= dict(status=status, why="; ".join(dict.fromkeys(why)) if not placed else "",
                        whole_s=round(whole_s, 2), fast_s=round(fast_s, 2), ops=len(whole.trace.ops))
            row.pop("error", None)
            break
        print(json.dumps(row), flush=True)


def run_one(model_type: str, timeout: float) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--worker", model_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out, why = done.stdout, f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        why = f"timeout after {timeout:.0f} s"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows or [dict(type=model_type, mode="-", status="failed", error=why)]


def table(rows: list[dict[str, Any]]) -> str:
    counts = Counter(r["status"].split(":")[0] for r in rows if r["mode"] != "build")
    placed = [r for r in rows if r.get("status") == "identical"]
    speed = sum(r["whole_s"] for r in placed) / max(sum(r["fast_s"] for r in placed), 1e-9)
    lines = [f"{sum(counts.values())} runs: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()),
             f"placed runs: {sum(r['whole_s'] for r in placed):.0f} s recording every block, "
             f"{sum(r['fast_s'] for r in placed):.0f} s with repeated blocks recorded once ({speed:.2f}x)", "",
             "| model type | class | mode | status | why recorded whole | ops | every block s | once s |",
             "|---|---|---|---|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["type"], r["mode"])):
        lines.append(f"| {r['type']} | {r.get('cls', '')} | {r['mode']} | {r['status']} | "
                     f"{(r.get('why') or r.get('error') or '').replace('|', '/')[:140]} | {r.get('ops', '')} | "
                     f"{r.get('whole_s', '')} | {r.get('fast_s', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--every", type=int, default=1, help="every N-th architecture only (a sample)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--results", help="JSON-lines file the rows are appended to (resumed when it exists)")
    parser.add_argument("--write", help="write the table to this Markdown file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from coverage import architectures

    types = (args.only.split(",") if args.only else architectures())[::args.every]
    rows: list[dict[str, Any]] = []
    if args.results and Path(args.results).exists():
        rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
        done = {r["type"] for r in rows}
        types = [t for t in types if t not in done]
    with ThreadPoolExecutor(args.jobs) as pool:
        for got in pool.map(lambda t: run_one(t, args.timeout), types):
            rows += got
            if args.results:
                with open(args.results, "a") as out:
                    out.writelines(json.dumps(r) + "\n" for r in got)
            for r in got:
                print(r["type"], r["mode"], r["status"], r.get("why") or r.get("error") or "", file=sys.stderr)
    text = table(rows)
    if args.write:
        sample = f"one architecture in {args.every} (alphabetically)" if args.every > 1 else \
            "every architecture"
        Path(args.write).write_text(HEADER.format(sample=sample, every=f" --every {args.every}" * (args.every > 1))
                                    + text + "\n")
    else:
        print(text)


HEADER = """# Repeated blocks recorded once, against recording every block

`python benchmarks/repeated_blocks.py{every} --write docs/repeated-blocks.md`: {sample} of the installed
transformers, each from its small config (as in docs/coverage.md) with its layer counts at 7, analysed with
repeated blocks recorded once (the default) and with every block recorded (`GRAPHMEM_REPEATED_BLOCKS=0`),
inference and one SGD training step.  "identical": the stack was recorded cut to four blocks and the
others placed by offset, and the two reports are the same (trace, fx graph, every number).  "recorded
whole": graphmem recorded every block, and the column says why (no stack of alike blocks, or the cut
recording did not rebuild itself).  "DIFFERENT" would be a bug.

"""

if __name__ == "__main__":
    main()
