"""The published real-GPU measurements benchmarks/published.py reproduces, and those it cannot.

Each ``Row`` is one published number: where it was published, what the source states, what
had to be assumed, the metric it is (``allocated`` = ``torch.cuda.max_memory_allocated()``,
``reserved`` = ``max_memory_reserved()``, ``active`` = ``memory_stats()["active_bytes.all.peak"]``,
``nvidia-smi`` = NVML's "used" for the process, ``oom`` = the run ran out of memory), the value
as stated and in bytes, and the run that reproduces it: a program under ``graphmem run`` on a
GPU preset.  ``NotExpressed`` rows say why graphmem cannot reproduce them.  Nothing here is a
graphmem number: the doc's graphmem column comes from running the rows.

The starting set is ../shared/research/gpu-published.md (ids kept: S1, S4, ...); the SDPA
tables are taken whole from the docs and pull requests that printed them.
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS = {"allocated": "torch.cuda.max_memory_allocated()", "reserved": "torch.cuda.max_memory_reserved()",
           "active": 'memory_stats()["active_bytes.all.peak"]', "nvidia-smi": "NVML used (nvidia-smi)",
           "oom": "out of memory on the GPU"}
MiB = 1 << 20


@dataclass(frozen=True)
class Run:
    """One ``graphmem run`` of a program in benchmarks/published_programs/: the program writes the
    counters it reads (JSON) to the file named by its ``--out``."""

    program: str
    argv: tuple[str, ...]
    gpu: str
    steps: int
    transformers: str | None = None  # a transformers release other than the installed one (a "site")


@dataclass(frozen=True)
class Row:
    """One published figure and how graphmem reproduces it."""

    id: str
    group: str            # the source table it belongs to (a key of SOURCES)
    what: str             # the configuration, in a few words
    metric: str           # a key of METRICS
    stated: str           # the value as the source prints it
    published_bytes: int  # the same in bytes (for "oom": the GPU memory the run did not fit in)
    run: Run
    counter: str = "max_memory_allocated"  # what the program wrote that this metric reads
    tolerance: float = 0.03
    outside_bytes: int = 0  # nvidia-smi rows: memory outside the allocator the source itself measured
    known_gap: Gap | None = None  # what the source's software held that graphmem's model of torch 2.13 does not


@dataclass(frozen=True)
class Gap:
    """Bytes the source's run held for a known reason graphmem does not model, with the reason."""

    reason: str
    nbytes: int


@dataclass(frozen=True)
class Source:
    """A table of published figures: where, what it states, what graphmem had to assume."""

    cite: str
    states: str
    assumed: str
    trust: str


@dataclass(frozen=True)
class NotExpressed:
    """A published figure graphmem does not reproduce, and why."""

    id: str
    cite: str
    what: str
    metric: str
    stated: str
    reason: str


SDPA_PROGRAM = "benchmarks/published_programs/sdpa_training.py"
SDPA_ASSUMED = ("the benchmark's own steps (benchmarks/published_programs/sdpa_training.py: one warm-up step, "
                "then peaks reset); the model built from the checkpoint's config.json values in fp16; ")

SOURCES = {
    "opt": Source(
        "huggingface/transformers docs/source/en/model_doc/opt.md (2024-25; the table of PR #33298, "
        "https://github.com/huggingface/transformers/pull/33298)",
        "facebook/opt-350m in float16, L40S-45GB, PyTorch 2.4.0; training benchmark of PR #31031 (fxmarty's "
        "script: random input_ids, all-ones attention_mask, logits.sum().backward(), no optimizer); "
        "'Eager/sdpa peak mem (MB)' = max_memory_allocated x 1e-6",
        SDPA_ASSUMED + "transformers 4.46.3, the first release with OPT's SDPA (the PR branch is not pinned)",
        "B"),
    "neox": Source(
        "huggingface/transformers docs/source/en/model_doc/gpt_neox.md (2024-25; the table of PR #31031, "
        "https://github.com/huggingface/transformers/pull/31031)",
        "EleutherAI/pythia-410m-deduped in float16, 'rtx3080ti-16GB', PyTorch 2.2.1; fxmarty's training "
        "benchmark (gist 7e75cc39); 'peak mem (MB)' = max_memory_allocated x 1e-6",
        SDPA_ASSUMED + "transformers 4.42.4 (the release that added GPT-NeoX's SDPA); the rtx-3090 preset "
        "(the same Ampere sm86 kernels and cuBLAS workspace; memory size does not change allocated)",
        "B"),
    "anatomy": Source(
        "huggingface/transformers docs/source/en/model_memory_anatomy.md (rev 249ef816) and "
        "docs/source/zh/perf_train_gpu_one.md (rev c0c397c2, the January 2022 page's numbers)",
        "google-bert/bert-large-uncased, AutoModelForSequenceClassification (2 labels), 512 random sequences of "
        "512 tokens, the Trainer with its defaults and each row's settings; Tesla V100-SXM2 16GB, driver 460.91, "
        "CUDA 11.2; NVML used memory // 2**20 printed as 'MB'; the CUDA context alone "
        "(torch.ones((1, 1)).to('cuda')) 1343 MB",
        "the Trainer of transformers 4.15 (December 2021) written out (benchmarks/published_programs/"
        "hf_trainer_2022.py), with torch 1.10's zero_grad (set_to_none=False) and that release's AdamW and "
        "Adafactor; the installed transformers' BERT with eager attention; graphmem's allocator and cuBLAS "
        "workspace (torch 2.13); outside the allocator the page's own 1343 MiB less the 2 MiB segment its "
        "1x1 tensor holds (1341 MiB): NVML = reserved + 1341 MiB",
        "B"),
    "bert": Source(
        "huggingface/transformers docs/source/en/model_doc/bert.md (2024-25; the SDPA table of PR #28802, "
        "https://github.com/huggingface/transformers/pull/28802)",
        "bert-base-uncased in float16, A100-80GB, PyTorch 2.2.0; fxmarty's training benchmark; "
        "'peak mem (MB)' = max_memory_allocated x 1e-6",
        SDPA_ASSUMED + "BertForMaskedLM with input_ids only, as the benchmark's masked-LM copy in PR #32092 "
        "(the PR names BertLMHeadModel: the same parameters and head); the installed transformers (its "
        "BERT gives the same bytes as 4.42.4 within 5 MB)",
        "B-"),
}


def _mb(text: str) -> int:
    """'1474.611' MB as the benchmark prints it: max_memory_allocated x 1e-6."""
    return round(float(text) * 1e6)


def _sdpa_rows(group: str, prefix: str, model: str, gpu: str, transformers: str | None,
               table: tuple[tuple[int, int, str, str], ...], oom_bytes: int) -> list[Row]:
    """One row per published figure of an SDPA training table: (batch, seq, eager MB, sdpa MB);
    'OOM' is a run that did not fit the GPU (``oom_bytes``); 'stale' a figure that is not this
    run's (published_unexpressed.py says why)."""
    rows = []
    for batch, seq, eager, sdpa in table:
        for attn, stated in (("eager", eager), ("sdpa", sdpa)):
            if stated == "stale":
                continue
            run = Run(SDPA_PROGRAM, ("--model", model, "--attn", attn, "--batch", str(batch), "--seq", str(seq)),
                      gpu, steps=3, transformers=transformers)
            oom = stated == "OOM"
            rows.append(Row(f"{prefix}-{batch}x{seq}-{attn}", group, f"{model}, {attn}, batch {batch} x {seq}",
                            "oom" if oom else "allocated", stated if oom else f"{stated} MB",
                            oom_bytes if oom else _mb(stated), run))
    return rows


OPT_TABLE = (
    (1, 128, "1474.611", "1474.32"), (1, 256, "1498.541", "1499.49"), (1, 512, "1973.544", "1551.35"),
    (1, 1024, "4867.113", "1698.35"), (1, 2048, "15662.224", "2715.75"),
    (2, 128, "1498.164", "1499.49"), (2, 256, "1569.367", "1551.35"), (2, 512, "3257.074", "1698.35"),
    (2, 1024, "9054.405", "2715.75"), (2, 2048, "30572.058", "4750.55"),
    (4, 128, "1549.448", "1551.35"), (4, 256, "2451.768", "1698.35"), (4, 512, "5833.180", "2715.75"),
    (4, 1024, "17427.842", "4750.55"), (4, 2048, "OOM", "stale"),
    (8, 128, "2049.115", "1697.78"), (8, 256, "4222.567", "2715.75"), (8, 512, "10985.391", "4750.55"),
    (8, 1024, "34175.763", "8821.18"), (8, 2048, "OOM", "stale"),
)
NEOX_TABLE = (
    (1, 128, "1789.95", "1789.95"), (1, 256, "1845.83", "1844.84"), (1, 512, "2278.38", "1953.76"),
    (1, 1024, "4772.36", "2408.35"), (1, 2048, "13484.1", "3882.01"),
    (2, 128, "1843.86", "1844.78"), (2, 256, "1999.72", "1951.67"), (2, 512, "3613.16", "2406.77"),
    (2, 1024, "8707.55", "3878.86"), (2, 2048, "OOM", "6825.13"),
    (4, 128, "1947.6", "1952.06"), (4, 256, "3008.39", "2405.99"), (4, 512, "6290.58", "3877.29"),
    (4, 1024, "OOM", "6821.98"), (4, 2048, "OOM", "12705.1"),
)
BERT_TABLE = (
    (4, 256, "939.213", "764.834"), (4, 512, "1970.447", "1227.162"), (8, 256, "1594.295", "1226.114"),
    (8, 512, "3629.401", "2134.262"), (16, 256, "2874.426", "2134.262"), (16, 512, "6964.659", "3961.013"),
)

TRAINER_PROGRAM = "benchmarks/published_programs/hf_trainer_2022.py"
ANATOMY_OUTSIDE = (1343 - 2) * MiB


def softmax_inputs(batch: int) -> Gap:
    """torch 1.10 kept each softmax's input for its backward as well as its output (PyTorch issue
    #64000, fixed in 1.11: ``_softmax_backward_data`` takes the input's dtype, not the input):
    BERT-large's 24 layers x batch x 16 heads x 512 x 512 attention scores in fp32 (under fp16
    autocast too: softmax runs in fp32)."""
    return Gap("torch 1.10 also kept each softmax's input for backward (PyTorch issue #64000): "
               f"24 layers x {batch} x 16 x 512 x 512 fp32", 24 * batch * 16 * 512 * 512 * 4)


def _anatomy(row: str, what: str, stated: str, *argv: str, counter: str = "memory_reserved",
             gap: Gap | None = None) -> Row:
    """A row of the 2022 page: NVML's used memory after loading or after training, in MiB."""
    return Row(row, "anatomy", what, "nvidia-smi", f"{stated} MB", int(stated) * MiB,
               Run(TRAINER_PROGRAM, argv, "v100-16gb", steps=3), counter=counter, tolerance=0.05,
               outside_bytes=ANATOMY_OUTSIDE, known_gap=gap)


ANATOMY_ROWS = (
    _anatomy("H6-load", "model loaded to the GPU (fp32)", "2631", "--batch", "4", counter="loaded_reserved"),
    _anatomy("H6", "batch 4, fp32, AdamW", "14949", "--batch", "4", gap=softmax_inputs(4)),
    _anatomy("H7", "batch 1 x 4 accumulated", "8681", "--batch", "1", "--grad-accum", "4", gap=softmax_inputs(1)),
    _anatomy("H8", "batch 1 x 4, gradient checkpointing", "6775", "--batch", "1", "--grad-accum", "4",
             "--gradient-checkpointing"),
    _anatomy("H9", "batch 4, fp16 AMP", "13939", "--batch", "4", "--fp16", gap=softmax_inputs(4)),
    _anatomy("H10", "batch 1 x 4, checkpointing, fp16", "7275", "--batch", "1", "--grad-accum", "4",
             "--gradient-checkpointing", "--fp16"),
    _anatomy("H11", "batch 4, Adafactor", "12295", "--batch", "4", "--optim", "adafactor", gap=softmax_inputs(4)),
    _anatomy("H12", "batch 1 x 4, checkpointing, fp16, Adafactor", "4847", "--batch", "1", "--grad-accum", "4",
             "--gradient-checkpointing", "--fp16", "--optim", "adafactor"),
    _anatomy("H13", "batch 4, bitsandbytes Adam8bit", "13085", "--batch", "4", "--optim", "adam8bit",
             gap=softmax_inputs(4)),
    _anatomy("H14", "batch 1 x 4, checkpointing, fp16, Adam8bit", "5363", "--batch", "1", "--grad-accum", "4",
             "--gradient-checkpointing", "--fp16", "--optim", "adam8bit"),
)

ROWS: tuple[Row, ...] = (
    *_sdpa_rows("opt", "OPT", "opt-350m", "l40s", "4.46.3", OPT_TABLE, 45589 * MiB),
    *_sdpa_rows("neox", "NEOX", "pythia-410m-deduped", "rtx-3090", "4.42.4", NEOX_TABLE, 16 * 1024 * MiB),
    *_sdpa_rows("bert", "BERT", "bert-base-uncased", "a100-80gb", None, BERT_TABLE, 81920 * MiB),
    *ANATOMY_ROWS,
)
