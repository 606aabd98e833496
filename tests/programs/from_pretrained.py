"""Fine-tuning from a checkpoint: AutoModelForCausalLM.from_pretrained(FOLDER) (the folder is
the first argument), two AdamW steps on random token ids, on the GPU when there is one."""

import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
model.to("cuda" if torch.cuda.is_available() else "cpu")
device = next(model.parameters()).device
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(0)
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (4, 32), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
