"""Published GPU figures benchmarks/published.py does not reproduce, each with the reason.

Ids and sources as in ../shared/research/gpu-published.md (its full citations are there).
"""

from __future__ import annotations

from benchmarks.published_rows import NotExpressed

_TITAN = "pytorch/torchtitan PR #165 (commit 83c879f1), llama 7B, local batch 8 x 2048, 8x H100"
_OCTO = "transformers docs/source/en/llm_tutorial_optimization.md (rev 008f5c8c), bigcode/octocoder 15.5B"
_LIT = "Lightning-AI/litgpt"
_TUNE = "pytorch/torchtune README 'Optimization flags' (PR #2003), Llama 3.2 3B"
_FSDP1 = ("FSDP1 (FullyShardedDataParallel: flat parameters, its rate limiter, record_stream frees) is not "
          "modelled, only FSDP2 (fully_shard); and torchtitan's own Llama code at 83c879f1 is not installed")
_COMPILED = "torch.compile: inductor fuses kernels and reuses buffers; graphmem records eager execution"

_OPT = "transformers docs/source/en/model_doc/opt.md (PR #33298), opt-350m, L40S"
_STALE = ("not this run's: where the eager run went out of memory, the table's sdpa figure repeats the one of the "
          "size before it ({before}); the table's other sizes show sdpa memory growing with batch x seq ({grows}), "
          "so compared it would measure the script, not graphmem")

NOT_EXPRESSED: tuple[NotExpressed, ...] = (
    NotExpressed("OPT-4x2048-sdpa", _OPT, "sdpa, batch 4 x 2048", "allocated", "4750.55 MB",
                 _STALE.format(before="4 x 1024: 4750.55 MB", grows="8 x 1024, as many tokens: 8821.18 MB")),
    NotExpressed("OPT-8x2048-sdpa", _OPT, "sdpa, batch 8 x 2048", "allocated", "8821.18 MB",
                 _STALE.format(before="8 x 1024: 8821.18 MB", grows="4,750.55 MB at 4,096 tokens, 8,821.18 at 8,192")),
    NotExpressed("T13", _TITAN, "FSDP1 x 8, full AC", "active / reserved", "24.81% / 33.82% of 95.04 GiB", _FSDP1),
    NotExpressed("T15", _TITAN, "FSDP1 x 8, selective op AC", "active / reserved", "52.98% / 67.23%", _FSDP1),
    NotExpressed("T16", _TITAN, "FSDP2 x 8 + compile, full AC", "reserved", "28.72 GiB", _COMPILED),
    NotExpressed("T17", _TITAN, "FSDP2 x 8 + compile, no AC", "reserved", "90.28 GiB", _COMPILED),
    NotExpressed("T18", _TITAN, "TP/SP 2 x FSDP2 4, local batch 16, full AC", "active / reserved",
                 "50.12% / 60.97%",
                 "torchtitan's Llama, its TP/SP plan (sequence parallel, loss parallel) and its AC wrapper at "
                 "83c879f1 are not installed; transformers' Llama with graphmem's TP plan is another program"),
    NotExpressed("H2", _OCTO, "pipeline() generation, 60 new tokens, load_in_8bit", "allocated", "15.219 GiB",
                 "bitsandbytes int8 inference through pipeline(): graphmem builds quantized bases for LoRA training "
                 "(--quantize-base), and the prompt's token count needs the tokenizer (no download)"),
    NotExpressed("H3", _OCTO, "as H2, load_in_4bit", "allocated", "9.544 GiB", "as H2"),
    NotExpressed("H4", _OCTO, "bf16, eager attention, long prompt", "allocated", "37.668 GiB",
                 "the prompt's token count is not stated (the text is; counting it needs the tokenizer, no download): "
                 "the attention scores grow with its square"),
    NotExpressed("H5", _OCTO, "bf16, BetterTransformer + flash SDPA, long prompt", "allocated", "32.617 GiB",
                 "as H4; and optimum's to_bettertransformer() is not installed"),
    NotExpressed("L3", f"{_LIT} tutorials/quantize.md@982abcbc", "falcon-7b generate 256, bnb.nf4", "allocated",
                 "5.72 GB", "litgpt's own GPT, KV cache and generate loop are not installed"),
    NotExpressed("L4", f"{_LIT} tutorials/quantize.md@982abcbc", "falcon-7b generate 256, bnb.int8", "allocated",
                 "8.70 GB", "as L3"),
    *(NotExpressed(row, f"{_LIT} config_hub/finetune/README.md", what, "allocated", value,
                   "litgpt not installed; sequences padded to the longest of each Alpaca2k batch (data-dependent) "
                   "and one maximum over epochs and the final validation generation (trust C+)")
      for row, what, value in (("L5", "Llama-2-7b LoRA r 32, A10G", "19.77 GB"),
                               ("L6", "Llama-3.2-1B full, A10G", "8.70 GB"),
                               ("L7", "TinyLlama full, A10G", "14.10 GB"),
                               ("L8", "phi-2 LoRA, A10G", "13.98 GB"),
                               ("L9", "phi-2 LoRA, 10 iterations", "13.90 GB"))),
    NotExpressed("U1", _TUNE, "full finetune, unpacked alpaca, batch 2", "active", "25.5 GiB",
                 "torchtune not installed; unpacked samples give data-dependent lengths (trust C)"),
    *(NotExpressed(row, _TUNE, what, "active", value, f"{_COMPILED}; torchtune not installed")
      for row, what, value in (("U3", "packed 4096, compile", "51.0 GiB"),
                               ("U4", "+ chunked cross-entropy", "42.9 GiB"),
                               ("U5", "+ full AC", "24.9 GiB"),
                               ("U6", "+ optimizer in backward", "23.1 GiB"),
                               ("U7", "+ activation offloading", "21.8 GiB"),
                               ("U8", "+ 8-bit AdamW", "17.6 GiB"),
                               ("U9", "LoRA / QLoRA", "8.5 / 4.6 GiB"))),
    NotExpressed("U10", "pytorch/torchtune README (PR #1664)", "Llama 3.1 8B recipes, compile", "not stated",
                 "18.9 GiB (4090) ...", "which counter is not stated; recipe defaults not restated; compiled"),
    NotExpressed("U11", "pytorch/torchtune qlora_finetune.rst", "Llama2-7B LoRA / QLoRA", "reserved",
                 "15.57 / 9.29 GB", "torchtune not installed; dynamic (unpacked) lengths; recipe defaults of the time"),
    NotExpressed("A1", "pytorch/ao torchao/optim/README.md", "timm ViT-H fine-tune, compile(fullgraph)", "allocated",
                 "12.23 GB", f"{_COMPILED}; timm and torchao not installed"),
    NotExpressed("PT1", "pytorch/tutorials optimizer_step_in_backward_tutorial.py", "vit_l_16, Adam", "allocated",
                 "~6 GB (read off a snapshot)", "torchvision not installed here; the figure is read by eye"),
    NotExpressed("PT2", "same tutorial", "vit_l_16, Adam in backward hooks", "allocated",
                 "~4 GB (read off a snapshot)", "as PT1"),
)
