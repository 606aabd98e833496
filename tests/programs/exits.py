import sys

import torch

model = torch.nn.Linear(4, 4)
sys.exit(0)
