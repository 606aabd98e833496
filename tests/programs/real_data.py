"""A program whose memory depends on its data: each batch is cut to its longest sequence
(``mask.sum(-1).max()``), and a packed index picks the tokens that are not padding.  graphmem
run must take these values from the program's own data, as the real run does.

    python tests/programs/real_data.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

LENGTHS = [5, 17, 9, 33, 12, 7, 25, 3, 40, 11, 2, 30]
WIDTH = 48


class Padded(Dataset):
    """Sequences of the lengths above, padded to WIDTH, with their masks."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = LENGTHS[i]
        ids = torch.zeros(WIDTH, dtype=torch.long)
        ids[:n] = torch.arange(1, n + 1)
        mask = torch.zeros(WIDTH, dtype=torch.bool)
        mask[:n] = True
        return ids, mask


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids, mask in DataLoader(Padded(), batch_size=4):
        longest = int(mask.sum(-1).max())  # padding cut to the longest sequence in the batch
        ids, mask = ids[:, :longest], mask[:, :longest]
        out = model(ids)
        loss = out[mask].float().pow(2).mean()  # the tokens that are not padding (boolean-mask indexing)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
