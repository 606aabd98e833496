"""Tiny data in the formats the wild programs read (tests/programs/wild/SOURCE.md), written by the
tests into their temporary folders: every file is made here from a fixed seed, nothing is
downloaded. Each writer returns what the program's command line names (a file or a folder).

Sizes are chosen so that each program's real run takes seconds on a CPU; the shapes are the
programs' own (MNIST's 28 x 28 images, Cora's node table, nanoGPT's uint16 token files)."""

from __future__ import annotations

import pickle
import random
import struct
from pathlib import Path

WORDS = [f"w{k}" for k in range(400)]


def words_text(lines: int, seed: int, per_line: int = 12) -> str:
    """Lines of words from a 400-word vocabulary (every word appears: the vocabulary's size is fixed)."""
    rng = random.Random(seed)
    out = [" ".join(WORDS)]
    for _ in range(lines - 1):
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(per_line // 2, per_line))))
    return "\n".join(out) + "\n"


def wikitext(folder: Path) -> Path:
    """word_language_model's corpus folder: train.txt, valid.txt, test.txt (data.Corpus reads all three)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(words_text(60, 1))
    (folder / "valid.txt").write_text(words_text(30, 2))
    (folder / "test.txt").write_text(words_text(30, 3))
    return folder


def lightning_wikitext(cwd: Path) -> Path:
    """lightning.pytorch.demos.WikiText2's file, ./data/wikitext-2.txt (it downloads only when the
    file is missing); long enough for the examples' split of n - 4000, 2000, 2000 blocks of 35."""
    path = cwd / "data" / "wikitext-2.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(words_text(1000, 4, per_line=300))  # few long lines: WikiText2 makes a tensor a line
    return path


def sine_waves(cwd: Path, n: int = 4, length: int = 12) -> Path:
    """time_sequence_prediction's ./traindata.pt: generate_sine_wave.py's float64 sines, n x length
    (its own script writes 100 x 1000)."""
    import numpy as np
    import torch

    rng = np.random.RandomState(2)
    x = np.empty((n, length), "int64")
    x[:] = np.array(range(length)) + rng.randint(-80, 80, n).reshape(n, 1)
    path = cwd / "traindata.pt"
    with open(path, "wb") as f:
        torch.save(np.sin(x / 1.0 / 20).astype("float64"), f)
    return path


def cora(cwd: Path, nodes: int = 1700, features: int = 16, edges: int = 3000) -> Path:
    """./cora/cora.content (id, binary features, label) and ./cora/cora.cites (cited, citing): the
    GAT example splits the nodes 1200 / 400 / the rest, so it needs more than 1600."""
    rng = random.Random(5)
    folder = cwd / "cora"
    folder.mkdir(parents=True, exist_ok=True)
    ids = [1000 + 7 * k for k in range(nodes)]
    rows = []
    for k, paper in enumerate(ids):
        bits = [rng.random() < 0.2 for _ in range(features)]
        bits[k % features] = True  # every node has a feature: no row of zeros
        rows.append("\t".join([str(paper), *("1" if b else "0" for b in bits), f"class_{k % 3}"]))
    (folder / "cora.content").write_text("\n".join(rows) + "\n")
    cites = [f"{rng.choice(ids)}\t{rng.choice(ids)}" for _ in range(edges)]
    (folder / "cora.cites").write_text("\n".join(cites) + "\n")
    return folder


def mnist(root: Path, train: int = 256, test: int = 64) -> Path:
    """torchvision's MNIST raw files under ROOT/MNIST/raw (the idx format: big-endian header, uint8
    pixels); with them present its download=True downloads nothing. Returns ROOT."""
    rng = random.Random(6)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", train), ("t10k", test)):
        pixels = bytes(rng.randrange(256) for _ in range(n * 28 * 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, n, 28, 28) + pixels)
        labels = bytes(k % 10 for k in range(n))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 2049, n) + labels)
    return root


def char_text(chars: int = 20000, seed: int = 7) -> str:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.\n"
    return "".join(rng.choice(alphabet) for _ in range(chars))


def nanogpt_dataset(folder: Path) -> Path:
    """nanoGPT's data/<dataset>/ as data/shakespeare_char/prepare.py writes it: train.bin and val.bin
    (uint16 token ids) and meta.pkl (vocab_size, itos, stoi)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    text = char_text()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(len(ids) * 0.9)
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return folder


NANOGPT_TINY = """\
# a tiny nanoGPT run on the CPU (written by tests/programs/wild/make_data.py)
out_dir = {out!r}
dataset = {data!r}
device = 'cpu'
dtype = 'float32'
compile = False
eval_interval = 2
eval_iters = 2
log_interval = 1
always_save_checkpoint = False
gradient_accumulation_steps = 2
batch_size = 4
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
max_iters = 4
lr_decay_iters = 4
warmup_iters = 1
"""


def nanogpt_config(folder: Path, data: Path, out: Path) -> Path:
    """A config file for nanoGPT's configurator (`python train.py CONFIG`): plain assignments."""
    path = folder / "tiny_cpu.py"
    path.write_text(NANOGPT_TINY.format(out=str(out), data=str(data)))
    return path


def names(path: Path, count: int = 400) -> Path:
    """makemore's input: one name a line."""
    rng = random.Random(8)
    letters = "abcdefghijklmnopqrstuvwxyz"
    path.write_text("\n".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
                              for _ in range(count)) + "\n")
    return path


def chargpt_input(cwd: Path) -> Path:
    """minGPT chargpt's ./input.txt."""
    path = cwd / "input.txt"
    path.write_text("O God, O God!\n" + char_text(5000, 9))  # the characters of the context it samples from
    return path
