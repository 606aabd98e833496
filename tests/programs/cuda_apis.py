"""A program that uses torch.cuda's API as GPU programs do: seeds, capability, free memory,
device contexts, NVTX ranges, streams and events, memory_summary, the generator's state,
synchronize, and activation checkpointing (which saves and restores the CUDA generator)."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.cuda.manual_seed_all(0)
print("capability", torch.cuda.get_device_capability(), torch.cuda.is_bf16_supported())
free, total = torch.cuda.mem_get_info()
print("free", free, "total", total)
with torch.cuda.device(0):
    torch.cuda.nvtx.range_push("setup")
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64)).cuda()
    torch.cuda.nvtx.range_pop()
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    pass
torch.cuda.current_stream().wait_stream(side)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
state = torch.cuda.get_rng_state()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    start.record()
    x = torch.randn(32, 64, device="cuda")
    loss = checkpoint(model, x, use_reentrant=False).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    print("step", start.elapsed_time(end), torch.cuda.memory_summary().splitlines()[0])
