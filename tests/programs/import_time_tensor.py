"""A module that makes a tensor when it is imported and keeps it (as some libraries keep
constants): every process that imports it holds it (tests/programs/fsdp_meta.py)."""

import torch

SCALE = torch.tensor(0.5)
