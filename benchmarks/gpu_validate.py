"""Predicted vs measured on a CUDA GPU: the zoo, every model x precision x optimizer.

Runs each zoo model (tests/models.py) for real on CUDA, in fp32 and under bf16 autocast, in
inference and in training with SGD and Adam, and compares ``torch.cuda.max_memory_allocated()``
/ ``max_memory_reserved()`` with graphmem's caching-allocator prediction
(``report.<mode>.allocator.allocated_peak_bytes`` / ``.reserved_peak_bytes`` of
``graphmem.analyze(..., device="cuda")``).  The measured step is the one graphmem records
(docs/how-it-works.md): two iterations of ``out = model(*inputs); loss = loss_fn(out);
loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` in a function whose locals die
at return; inference is one ``model(*inputs)`` under ``torch.no_grad()``.  Before each row the
allocator is emptied (cuBLAS workspaces cleared, ``empty_cache()``) and its peaks reset, so
every row starts from a fresh cache.  A failing row is reported, not fatal.

    python benchmarks/gpu_validate.py                              # print the markdown page
    python benchmarks/gpu_validate.py --write docs/accuracy-gpu.md
    python benchmarks/gpu_validate.py --dry-run --models mlp       # on CPU: plumbing only

``--dry-run`` runs the same steps on CPU (measured columns are n/a) and still asks graphmem
for its CUDA prediction, so everything but the CUDA measurement is exercised.

Then whole programs (benchmarks/gpu_programs/): transformers GPT-2 and Llama training in fp32
and under bf16 autocast, and FSDP2 on one GPU (a process group of world size 1), each run for
real in a process of its own (it prints ``torch.cuda.max_memory_allocated()`` /
``max_memory_reserved()`` after its second optimizer step) and predicted by ``graphmem run``
with the preset of this GPU; and a generation row: the prefill and the last decode step of
``--generate`` (graphmem/trace/step/generation.py's procedure, for real on the GPU).
``--programs none`` leaves them out.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphmem
from graphmem.cuda.alloc_conf import parse_alloc_conf
from graphmem.cuda.allocator import MemoryEvent, replay
from graphmem.cuda.gpus import GPUS
from graphmem.job.choices import DEFAULT_GPU
from tests.models import ZOO, ZooModel
from tests.oracles import OPTIMIZERS, real_inputs


@dataclass(frozen=True)
class Config:
    """One column of the sweep: mode, optimizer (training) and autocast dtype."""

    name: str
    mode: str               # "inference" | "train"
    optimizer: str | None   # a tests.oracles.OPTIMIZERS key, None for inference
    amp: str | None         # None (fp32) or "bf16"


CONFIGS = (
    Config("inference-fp32", "inference", None, None),
    Config("inference-bf16", "inference", None, "bf16"),
    Config("train-fp32-sgd", "train", "sgd", None),
    Config("train-fp32-adam", "train", "adam", None),
    Config("train-bf16-sgd", "train", "sgd", "bf16"),
    Config("train-bf16-adam", "train", "adam", "bf16"),
)


@dataclass(frozen=True)
class Row:
    """Predicted and measured bytes for one model x config; None where not available."""

    model: str
    config: str
    predicted_allocated: int | None
    measured_allocated: int | None
    predicted_reserved: int | None
    measured_reserved: int | None
    note: str


def _first_float(out: Any) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_flatten(out)[0]
    return next(t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())


def _loss(out: Any, loss: str, targets: list[torch.Tensor]) -> torch.Tensor:
    """The loss graphmem's ``--loss`` applies; class targets are made once and then held."""
    logits = _first_float(out)
    if loss == "sum":
        return logits.sum()
    if loss == "mean":
        return logits.mean()
    if not targets:
        targets.append(torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device))
    fn = torch.nn.functional.cross_entropy if loss == "cross_entropy" else torch.nn.functional.nll_loss
    return fn(logits.reshape(-1, logits.shape[-1]), targets[0].reshape(-1))


def _autocast(device: str, amp: str | None) -> Any:
    return torch.autocast(device, dtype=torch.bfloat16) if amp == "bf16" else nullcontext()


def run_step(module: torch.nn.Module, inputs: list[torch.Tensor], model: ZooModel, config: Config,
             device: str) -> None:
    """The step graphmem records, for real on ``device``."""
    if config.mode == "inference":
        module.eval()
        with torch.no_grad(), _autocast(device, config.amp):
            out = module(*inputs)
        del out
        return
    module.train()
    assert config.optimizer is not None
    opt = OPTIMIZERS[config.optimizer]([p for p in module.parameters() if p.requires_grad])
    targets: list[torch.Tensor] = []

    def step() -> None:
        with _autocast(device, config.amp):
            out = module(*inputs)
            loss = _loss(out, model.loss, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()


def fresh_allocator() -> None:
    """Drop every cached block and cuBLAS workspace, then restart the peak counters."""
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def measure(model: ZooModel, config: Config, device: str) -> tuple[int | None, int | None]:
    """(max_memory_allocated, max_memory_reserved) of one real run; (None, None) off CUDA."""
    cuda = device == "cuda"
    if cuda:
        fresh_allocator()
    torch.manual_seed(0)
    module = model.build().to(device)
    inputs = [t.to(device) for t in real_inputs(model.inputs, model.int_high)]
    run_step(module, inputs, model, config, device)
    if not cuda:
        return None, None
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    del module, inputs
    fresh_allocator()
    return measured


def predict(model: ZooModel, config: Config) -> tuple[int | None, int | None]:
    """graphmem's CUDA prediction; None for a value the report does not carry (yet)."""
    report = graphmem.analyze(model.build, list(model.inputs), mode=config.mode,
                              optimizer=config.optimizer or "adam", loss=model.loss,
                              device="cuda", amp=config.amp)
    mode_report = report.train if config.mode == "train" else report.inference
    allocator = getattr(mode_report, "allocator", None)
    return (getattr(allocator, "allocated_peak_bytes", None), getattr(allocator, "reserved_peak_bytes", None))


def _attempt(fn: Callable[[], tuple[int | None, int | None]], what: str, notes: list[str]
             ) -> tuple[int | None, int | None]:
    try:
        return fn()
    except Exception as error:
        notes.append(f"{what}: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}")
        return None, None


def compare(model: ZooModel, config: Config, device: str) -> Row:
    """One row: predict, then measure, each caught separately."""
    notes: list[str] = []
    predicted = _attempt(lambda: predict(model, config), "predict", notes)
    measured = _attempt(lambda: measure(model, config, device), "measure", notes)
    if device == "cuda" and None in measured:
        fresh_allocator()
    return Row(model.name, config.name, predicted[0], measured[0], predicted[1], measured[1], "; ".join(notes))


# The allocator model alone, against the real allocator: random torch.empty/del sequences.
ALLOCATOR_CONFS = ("", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4")


def random_events(count: int, seed: int) -> list[MemoryEvent]:
    """A random alloc/free sequence: empty, small (< 1 MiB), mid (1-10 MiB) and large sizes."""
    rng = random.Random(seed)
    events: list[MemoryEvent] = []
    live: list[int] = []
    for index in range(count):
        if live and rng.random() < 0.5:
            events.append(MemoryEvent("free", live.pop(rng.randrange(len(live))), 0, index))
            continue
        high = rng.choice([1, 1 << 20, 10 << 20, 100 << 20])
        events.append(MemoryEvent("alloc", index, rng.randint(0, high), index))
        live.append(index)
    return events


def replay_for_real(events: Sequence[MemoryEvent], conf: str) -> list[tuple[int, int]]:
    """(memory_allocated, memory_reserved) after each event, allocating with torch.empty."""
    settings = torch.cuda.memory._set_allocator_settings
    fresh_allocator()
    settings("expandable_segments:False")  # every call also resets max_split_size and roundup
    if conf:
        settings(conf)
    live: dict[int, torch.Tensor] = {}
    after: list[tuple[int, int]] = []
    for event in events:
        if event.kind == "alloc":
            live[event.sid] = torch.empty(event.nbytes, dtype=torch.uint8, device="cuda")
        else:
            del live[event.sid]
        after.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    live.clear()
    fresh_allocator()
    settings("expandable_segments:False")
    return after


def allocator_rows(device: str, count: int = 2000) -> list[str]:
    """Per config: how many events the model matches exactly, and the first mismatch."""
    lines = [("| PYTORCH_CUDA_ALLOC_CONF | events | (allocated, reserved) equal after | first mismatch: "
             "event, predicted, measured |"), "|---|---:|---:|---|"]
    for seed, conf in enumerate(ALLOCATOR_CONFS):
        events = random_events(count, seed)
        stats = replay(events, parse_alloc_conf(conf))
        predicted = list(zip(stats.allocated_timeline, stats.reserved_timeline, strict=False))
        if device != "cuda":
            lines.append(f"| {conf or '(default)'} | {count} | n/a (dry run) | n/a |")
            continue
        measured = replay_for_real(events, conf)
        same = sum(p == m for p, m in zip(predicted, measured, strict=False))
        first = next((i for i, (p, m) in enumerate(zip(predicted, measured, strict=False)) if p != m), None)
        where = "none" if first is None else f"{first}, {predicted[first]}, {measured[first]}"
        lines.append(f"| {conf or '(default)'} | {count} | {same} | {where} |")
    return lines


# Whole programs: (row name, script in benchmarks/gpu_programs, its argv, processes: None for
# python, 1 for torchrun with one process)
PROGRAMS = ROOT / "benchmarks" / "gpu_programs"
PROGRAM_ROWS = (
    ("transformers GPT-2 (4 layers, 4x256 tokens)", "train-fp32-adamw", "hf_train.py", ("gpt2",), None),
    ("transformers GPT-2 (4 layers, 4x256 tokens)", "train-bf16-adamw", "hf_train.py", ("gpt2", "--bf16"), None),
    ("transformers Llama (4 layers, 4x256 tokens)", "train-fp32-adamw", "hf_train.py", ("llama",), None),
    ("transformers Llama (4 layers, 4x256 tokens)", "train-bf16-adamw", "hf_train.py", ("llama", "--bf16"), None),
    ("FSDP2, world size 1, transformers Llama", "train-fp32-adamw", "fsdp_one_gpu.py", (), 1),
)


def gpu_preset(device: str) -> str:
    """The preset whose product name is this GPU's (else graphmem's default)."""
    if device != "cuda":
        return DEFAULT_GPU
    product = torch.cuda.get_device_name(0)
    return next((gpu.name for gpu in GPUS.values() if gpu.product == product), DEFAULT_GPU)


def measure_program(script: str, argv: Sequence[str], device: str) -> tuple[int | None, int | None]:
    """The program's own MEASURED line, run in a process of its own (None, None off CUDA)."""
    done = subprocess.run([sys.executable, str(PROGRAMS / script), *argv], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("MEASURED ")), None)
    if line is None:
        return None, None
    allocated, reserved = line.split()[1:3]
    return int(allocated), int(reserved)


def predict_program(script: str, argv: Sequence[str], processes: int | None, preset: str
                    ) -> tuple[int | None, int | None]:
    """``graphmem run --gpu PRESET`` of the program, two optimizer steps."""
    report = graphmem.run_program(str(PROGRAMS / script), list(argv), steps=2, gpu=preset,
                                  nproc_per_node=processes).train
    allocator = report.allocator if report is not None else None
    return ((allocator.allocated_peak_bytes, allocator.reserved_peak_bytes) if allocator is not None
            else (None, None))


def program_rows(device: str) -> list[Row]:
    preset, rows = gpu_preset(device), []
    for name, config, script, argv, processes in PROGRAM_ROWS:
        notes: list[str] = []
        predicted = _attempt(functools.partial(predict_program, script, argv, processes, preset), "predict", notes)
        measured = _attempt(functools.partial(measure_program, script, argv, device), "measure", notes)
        rows.append(Row(name, config, predicted[0], measured[0], predicted[1], measured[1], "; ".join(notes)))
    return rows + generation_rows(device, preset)


# --generate P+N x batch on a small transformers Llama, as graphmem/trace/step/generation.py does it
GENERATE = (256, 64, 4)


def _generation_llama() -> torch.nn.Module:
    import transformers as T

    config = T.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    return T.LlamaForCausalLM(config)


def measure_generation(device: str) -> dict[str, tuple[int | None, int | None]]:
    """Prefill of the prompt; then a cache of prompt + new - 1 tokens and one decode step."""
    prompt, new, batch = GENERATE
    found: dict[str, tuple[int | None, int | None]] = {}
    for phase, length in (("prefill", prompt), ("decode", prompt + new - 1)):
        if device == "cuda":
            fresh_allocator()
        torch.manual_seed(0)
        model = _generation_llama().to(device).eval()
        ids = torch.randint(0, 8192, (batch, length), device=device)
        token = torch.randint(0, 8192, (batch, 1), device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            out: Any = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            if phase == "decode":
                cache = out.past_key_values
                del out
                out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                del cache
        del out
        if device == "cuda":
            torch.cuda.synchronize()
            found[phase] = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        else:
            found[phase] = None, None
        del model, ids, token
    return found


def generation_rows(device: str, preset: str) -> list[Row]:
    prompt, new, batch = GENERATE
    notes: list[str] = []
    predicted: dict[str, tuple[int | None, int | None]] = {"prefill": (None, None), "decode": (None, None)}
    measured: dict[str, tuple[int | None, int | None]] = {"prefill": (None, None), "decode": (None, None)}

    def predict() -> tuple[int | None, int | None]:
        report = graphmem.analyze(_generation_llama, [], generate=f"{prompt}+{new}", batch=batch, device="cuda",
                                  gpu=preset).generate
        assert report is not None
        for phase, mode in (("prefill", report.prefill), ("decode", report.decode)):
            stats = mode.allocator
            predicted[phase] = (stats.allocated_peak_bytes, stats.reserved_peak_bytes) if stats else (None, None)
        return None, None

    def measure() -> tuple[int | None, int | None]:
        measured.update(measure_generation(device))
        return None, None
    _attempt(predict, "predict", notes)
    _attempt(measure, "measure", notes)
    name = f"transformers Llama, --generate {prompt}+{new} x {batch}"
    return [Row(name, phase, *_pair(predicted[phase], measured[phase]), "; ".join(notes))
            for phase in ("prefill", "decode")]


def _pair(predicted: tuple[int | None, int | None], measured: tuple[int | None, int | None]
          ) -> tuple[int | None, int | None, int | None, int | None]:
    return predicted[0], measured[0], predicted[1], measured[1]


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _error(predicted: int | None, measured: int | None) -> str:
    if predicted is None or measured is None or measured == 0:
        return "n/a"
    return f"{(predicted - measured) / measured:+.2%}"


def render_table(rows: Sequence[Row], gpu: str, torch_version: str) -> str:
    """The markdown table, then the notes of rows that failed."""
    lines = [("| model | config | predicted allocated (B) | measured allocated (B) | error | predicted reserved (B) "
             "| measured reserved (B) | error | GPU | torch |"), "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.config} | {_bytes(r.predicted_allocated)} | {_bytes(r.measured_allocated)} "
                     f"| {_error(r.predicted_allocated, r.measured_allocated)} | {_bytes(r.predicted_reserved)} "
                     f"| {_bytes(r.measured_reserved)} | {_error(r.predicted_reserved, r.measured_reserved)} "
                     f"| {gpu} | {torch_version} |")
    notes = [f"- {r.model} / {r.config}: {r.note}" for r in rows if r.note]
    return "\n".join(lines + (["", "Notes:", "", *notes] if notes else []))


def calibration() -> list[str]:
    """Facts about this GPU for graphmem/cuda/gpus.py: total memory, cuBLAS workspace, CUDA context."""
    props = torch.cuda.get_device_properties(0)
    a = torch.ones(64, 64, device="cuda")
    before = torch.cuda.memory_allocated()
    product = a @ a  # the first cuBLAS call of this thread allocates its workspace
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - product.untyped_storage().nbytes()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    size_fn = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    del a, product
    return [(f"- device: {props.name}, compute capability {props.major}.{props.minor}, "
            f"total_memory {props.total_memory:,} B"),
            (f"- first cuBLAS call allocated {workspace:,} B (torch.backends.cuda.cublas_workspace_size(): "
            f"{size_fn() if callable(size_fn) else 'n/a'})"),
            (f"- memory in use outside PyTorch's allocator (the CUDA context, if no other process uses the GPU): "
            f"{context:,} B")]


def page(rows: Sequence[Row], gpu: str, dry_run: bool, facts: list[str], seconds: float,
         allocator: list[str]) -> str:
    head = ("# Accuracy on a CUDA GPU: predicted vs measured allocator peaks\n\n"
            "Generated by `python benchmarks/gpu_validate.py --write docs/accuracy-gpu.md`. Measured = "
            "`torch.cuda.max_memory_allocated()` / `max_memory_reserved()` over the step graphmem records "
            "(two training iterations, or one inference call), starting from an emptied cache; predicted = "
            "`report.<mode>.allocator` of `graphmem.analyze(..., device=\"cuda\")`. Error = "
            "(predicted - measured) / measured.\n\n")
    if dry_run:
        head += ("**Dry run on CPU: no GPU measurement.** Measured columns are n/a; this page only shows that "
                 "the script runs. Regenerate it on a machine with a CUDA GPU.\n\n")
    tail = ["", "## The allocator model alone", "",
            ("Random alloc/free sequences (`torch.empty(n, dtype=torch.uint8)` / `del`), replayed by "
            "`graphmem.cuda.allocator.replay` and for real, compared after every event."), "", *allocator]
    tail += ["", "## This GPU", "", *facts] if facts else []
    return head + render_table(rows, gpu, torch.__version__) + "\n" + "\n".join(tail) + \
        f"\n\n(Rows: {len(rows)}; {seconds:.0f} s.)\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="write the markdown page here")
    parser.add_argument("--dry-run", action="store_true", help="run on CPU without measuring (plumbing check)")
    parser.add_argument("--models", nargs="*", default=None, help=f"zoo names (default all: "
                        f"{', '.join(m.name for m in ZOO)})")
    parser.add_argument("--configs", nargs="*", default=None, help=f"config names (default all: "
                        f"{', '.join(c.name for c in CONFIGS)})")
    parser.add_argument("--programs", choices=("all", "none"), default="all",
                        help="the whole programs and the generation row (default all)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    models = [m for m in ZOO if args.models is None or m.name in args.models]
    configs = [c for c in CONFIGS if args.configs is None or c.name in args.configs]
    start = time.perf_counter()
    facts = calibration() if device == "cuda" else []
    rows = [compare(model, config, device) for model in models for config in configs]
    rows += program_rows(device) if args.programs == "all" else []
    gpu = "none (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    allocator = allocator_rows(device)
    text = page(rows, gpu, args.dry_run, facts, time.perf_counter() - start, allocator)
    if args.write:
        args.write.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
