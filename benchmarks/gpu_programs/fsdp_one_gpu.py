"""FSDP2 on one GPU (a process group of world size 1): a small transformers Llama with each
decoder layer and the root wrapped by ``fully_shard``, two AdamW steps; prints torch.cuda's peak
counters after the second step.  Runs as ``python fsdp_one_gpu.py`` (it sets torchrun's
variables itself when they are missing) or under torchrun with one process."""

import os

import torch
import torch.distributed as dist
import transformers as T
from torch.distributed.fsdp import fully_shard

for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", "29533")):
    os.environ.setdefault(name, value)
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
config = T.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
with torch.device(device):
    model = T.LlamaForCausalLM(config)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
torch.manual_seed(0)
for _ in range(2):
    ids = torch.randint(0, config.vocab_size, (4, 256), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
if cuda:
    print("MEASURED", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
dist.destroy_process_group()
