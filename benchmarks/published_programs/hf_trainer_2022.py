"""transformers' "model memory anatomy" experiments of January 2022, as that Trainer ran them.

The page (docs/source/en/model_memory_anatomy.md and perf_train_gpu_one.md, kept in the zh
translation) trains google-bert/bert-large-uncased with a sequence-classification head (2
labels) on 512 random sequences of 512 tokens (ids 100..30000, labels 0) with the ``Trainer``
of the time on a V100 16GB (driver 460.91, CUDA 11.2), and prints NVML's used memory after
``torch.ones((1, 1)).to("cuda")`` (1343 MiB), after loading the model (2631 MiB) and after
``trainer.train()`` for each setting: batch size, gradient accumulation, gradient checkpointing,
fp16 and the optimizer (transformers' AdamW, its Adafactor, or bitsandbytes' Adam8bit given to the
Trainer).

The Trainer of transformers 4.15 (December 2021) ran each optimizer step as written out in
``train`` below (trainer.py ``train`` and ``training_step``): forward under autocast with fp16,
the loss divided by the accumulation steps, backward (through a GradScaler with fp16), after the
last micro-batch the scaler's unscale, ``clip_grad_norm_(1.0)``, the optimizer step and
``model.zero_grad()``, which torch 1.10 ran with ``set_to_none=False``: the gradients stay
allocated, zeroed, for the rest of training.  Its optimizers were transformers' own ``AdamW``
(the default) and ``Adafactor`` (``adafactor=True``, with scale_parameter and relative_step
off), both since removed from transformers; their steps are written out here from
transformers 4.15.0's optimization.py.

Under ``graphmem run`` (every tensor a fake one) this writes ``torch.cuda``'s counters to
``--out`` (JSON) after loading and after every optimizer step: ``memory_reserved`` is what the
allocator holds, which NVML counts with the CUDA context.

    graphmem run --gpu v100-16gb --steps 3 benchmarks/published_programs/hf_trainer_2022.py \\
        --batch 4 --out counters.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

# google-bert/bert-large-uncased config.json; 2 labels (AutoModelForSequenceClassification's default)
BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                  vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, num_labels=2)
SEQ = 512


class AdamWHF(torch.optim.Optimizer):
    """transformers 4.15 ``AdamW`` (``optim="adamw_hf"``), one parameter at a time."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 5e-5, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                size = group["lr"] * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                p.addcdiv_(exp_avg, denom, value=-size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


class AdafactorHF(torch.optim.Optimizer):
    """transformers 4.15 ``Adafactor`` as the Trainer built it (fixed lr, no first moment)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 5e-5) -> None:
        super().__init__(params, dict(lr=lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8))

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state, factored = p.grad, self.state[p], p.dim() >= 2
                if not state:
                    state["step"] = 0
                    if factored:
                        state["row"] = torch.zeros(grad.shape[:-1]).to(grad)
                        state["col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:]).to(grad)
                    else:
                        state["sq"] = torch.zeros_like(grad)
                state["step"] += 1
                state["RMS"] = self._rms(p)
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = (grad**2) + group["eps"][0]
                if factored:
                    state["row"].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    state["col"].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    r = (state["row"] / state["row"].mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = torch.mul(r, state["col"].unsqueeze(-2).rsqrt())
                    update.mul_(grad)
                else:
                    state["sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = state["sq"].rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(group["lr"])
                p.add_(-update)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--optim", default="adamw_hf", choices=["adamw_hf", "adafactor", "adam8bit"])
    parser.add_argument("--out", required=True, help="where the counters go (JSON, rewritten at each step)")
    return parser.parse_args()


_SEEN: dict[str, int] = {}


def counters(out: str, **more: int) -> None:
    """Write the counters now (and what earlier calls added) to ``out``."""
    _SEEN.update(more, memory_reserved=torch.cuda.memory_reserved(),
                 max_memory_reserved=torch.cuda.max_memory_reserved(),
                 max_memory_allocated=torch.cuda.max_memory_allocated())
    with open(out, "w") as f:
        json.dump(_SEEN, f)


def optimizer_for(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """Trainer.create_optimizer: two groups (no weight decay on biases and LayerNorm; the
    default weight decay is 0 anyway)."""
    no_decay = {n for n, _ in model.named_parameters() if "bias" in n or "LayerNorm" in n}
    groups = [{"params": [p for n, p in model.named_parameters() if n not in no_decay]},
              {"params": [p for n, p in model.named_parameters() if n in no_decay]}]
    if name == "adam8bit":  # the page's own: bnb.optim.Adam8bit over the same groups, the Trainer's defaults
        import bitsandbytes as bnb

        return bnb.optim.Adam8bit(groups, betas=(0.9, 0.999), eps=1e-8, lr=5e-5)
    return AdafactorHF(groups) if name == "adafactor" else AdamWHF(groups)


def train(model: nn.Module, args: argparse.Namespace) -> None:
    """Trainer.train of transformers 4.15 (its steps as written there), until graphmem stops it."""
    optimizer = optimizer_for(model, args.optim)
    scaler = torch.cuda.amp.GradScaler() if args.fp16 else None
    tr_loss = torch.tensor(0.0).to("cuda")
    model.zero_grad(set_to_none=False)
    step = 0
    while True:  # the epochs' batches; graphmem run --steps stops it
        inputs = {"input_ids": torch.randint(100, 30000, (args.batch, SEQ)).to("cuda"),
                  "labels": torch.zeros(args.batch, dtype=torch.int64).to("cuda")}
        model.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            loss = model(**inputs)["loss"]
        loss = loss / args.grad_accum if args.grad_accum > 1 else loss
        (scaler.scale(loss) if scaler else loss).backward()
        tr_loss += loss.detach()
        step += 1
        if step % args.grad_accum == 0:
            if scaler:
                scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            model.zero_grad(set_to_none=False)  # torch 1.10's default
            counters(args.out)


def main() -> None:
    args = parse_args()
    torch.ones((1, 1)).to("cuda")  # the page's first measurement: the CUDA context (1343 MiB)
    config = BertConfig(**BERT_LARGE)
    config._attn_implementation = "eager"  # 2022's BERT had no other attention
    model = BertForSequenceClassification(config).to("cuda")
    if args.gradient_checkpointing:  # transformers 4.15: torch.utils.checkpoint, reentrant (torch 1.10's only kind)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    counters(args.out, loaded_reserved=torch.cuda.memory_reserved())
    train(model, args)


if __name__ == "__main__":
    main()
