"""An HF Trainer script as users write it: a tiny GPT-2 config built locally, an in-memory
dataset, max_steps=2, no saving, no logging service.  Arguments: the output folder, and --cuda
to train on the GPU (else use_cpu=True)."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.arange(i, i + 32) % 512
        return {"input_ids": ids, "labels": ids.clone()}


folders = [a for a in sys.argv[1:] if not a.startswith("--")]
args = TrainingArguments(output_dir=folders[0] if folders else "trainer-out",
                         per_device_train_batch_size=4, max_steps=2,
                         report_to=[], save_strategy="no", logging_steps=1, use_cpu="--cuda" not in sys.argv,
                         dataloader_num_workers=0, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Data()).train()
