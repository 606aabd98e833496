"""Two AdamW steps of a small transformers causal LM built from a local config (no download):
``python hf_train.py gpt2|llama [--bf16]``.  On a GPU when there is one; prints what
torch.cuda's peak counters say after the second step (under ``graphmem run`` they answer from
graphmem's allocator model, for real from the GPU's)."""

import sys

import torch
import transformers as T

name, bf16 = sys.argv[1], "--bf16" in sys.argv
if name == "gpt2":
    config = T.GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, n_positions=512)
    model = T.GPT2LMHeadModel(config)
else:
    config = T.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    model = T.LlamaForCausalLM(config)
device = "cuda" if torch.cuda.is_available() else "cpu"
model.to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(0)
for _ in range(2):
    ids = torch.randint(0, config.vocab_size, (4, 256), device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
if device == "cuda":
    print("MEASURED", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
