"""The training benchmark behind transformers' SDPA tables, on a model built from its config.

The tables of transformers' SDPA pull requests and model docs (OPT #33298, GPT-NeoX #31031,
BERT #28802 and the BERT doc) were made with fxmarty's training benchmark (gist 7e75cc39...,
named in #31031 and #28802; a copy for masked-LM models is in #32092).  It loads the checkpoint
in fp16 on the GPU, makes one random batch (``torch.randint(vocab - 1, (batch, seq))``, with an
all-ones ``attention_mask`` for causal LMs), and times warm-up and measured steps of

    model.zero_grad(); outputs = model(**inputs); loss = outputs.logits.sum(); loss.backward()

with ``torch.cuda.reset_peak_memory_stats()`` and ``empty_cache()`` between them; the table's
"peak mem (MB)" is ``torch.cuda.max_memory_allocated() * 1e-6`` after the measured steps.

This program runs those steps on the model built from the checkpoint's published config
(``--model``; no weights: under ``graphmem run`` every tensor is a fake one), one warm-up step
and measured steps until ``graphmem run --steps`` stops it, and after every measured step writes
the counters the benchmark reads to ``--out`` (JSON): ``max_memory_allocated``,
``max_memory_reserved`` and ``active_bytes.all.peak``, in bytes.

    graphmem run --gpu l40s --steps 3 benchmarks/published_programs/sdpa_training.py \\
        --model opt-350m --attn eager --batch 1 --seq 128 --out counters.json
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

# name -> (transformers class, the checkpoint's config.json values that shape memory, causal LM)
MODELS = {
    # facebook/opt-350m
    "opt-350m": ("OPTForCausalLM", dict(
        hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16, vocab_size=50272,
        max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False, dropout=0.1,
        attention_dropout=0.0, activation_function="relu", enable_bias=True, pad_token_id=1), True),
    # EleutherAI/pythia-410m-deduped
    "pythia-410m-deduped": ("GPTNeoXForCausalLM", dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, vocab_size=50304,
        rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048, use_parallel_residual=True,
        tie_word_embeddings=False, hidden_act="gelu", attention_dropout=0.0, hidden_dropout=0.0), True),
    # google-bert/bert-base-uncased
    "bert-base-uncased": ("BertForMaskedLM", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
        max_position_embeddings=512, type_vocab_size=2, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1), False),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", required=True, help="where the counters go (JSON, rewritten after each step)")
    return parser.parse_args()


def build(name: str, attn: str) -> tuple[torch.nn.Module, int, bool]:
    """The model in fp16 on the GPU, as ``from_pretrained(..., torch_dtype=torch.float16)``
    under ``torch.device("cuda")`` makes it; its vocabulary size; whether it is a causal LM."""
    class_name, values, causal = MODELS[name]
    cls = getattr(transformers, class_name)
    config = cls.config_class(**values)
    config._attn_implementation = attn
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            model = cls(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.to("cuda"), config.vocab_size, causal


def benchmark_training(model: torch.nn.Module, inputs: dict[str, torch.Tensor], warmup: int, out: str) -> None:
    """The benchmark's own loop.  Its steps run in one function, so ``outputs`` (the logits) and
    ``loss`` of a step stay referenced until the next step's forward has returned: two steps'
    logits are live at once, from the warm-up on."""
    model.train()
    for _ in range(warmup):
        model.zero_grad()
        outputs = model(**inputs)
        loss = outputs.logits.sum()
        loss.backward()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    while True:  # graphmem run --steps stops it
        model.zero_grad()
        outputs = model(**inputs)
        loss = outputs.logits.sum()
        loss.backward()
        counters = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                    "max_memory_reserved": torch.cuda.max_memory_reserved(),
                    "active_bytes.all.peak": torch.cuda.memory_stats()["active_bytes.all.peak"]}
        with open(out, "w") as f:
            json.dump(counters, f)


def main() -> None:
    args = parse_args()
    model, vocab, causal = build(args.model, args.attn)
    inputs = {"input_ids": torch.randint(vocab - 1, (args.batch, args.seq), dtype=torch.int64).to("cuda")}
    if causal:
        inputs["attention_mask"] = torch.ones(args.batch, args.seq, dtype=torch.int64).to("cuda")
    benchmark_training(model, inputs, args.warmup, args.out)


if __name__ == "__main__":
    main()
