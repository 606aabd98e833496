"""Half-precision causal attention on the GPU, in torch.nn.attention.sdpa_kernel(BACKEND) when
a backend is given as the first argument (flash, efficient or math), else PyTorch's choice."""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
          "math": SDPBackend.MATH}.get(sys.argv[1] if len(sys.argv) > 1 else "")
lin = nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(lin.parameters())
for _ in range(2):
    q = lin(torch.randn(2, 4, 128, 64, device="cuda")).half()
    with sdpa_kernel(chosen) if chosen is not None else torch.enable_grad():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.float().sum().backward()
    opt.step()
