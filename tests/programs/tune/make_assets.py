"""Tiny local assets for tests/programs/tune's configs (nothing downloaded):

    python make_assets.py DIR    writes DIR/tokenizer.model, DIR/ckpt/model.pt, DIR/alpaca.json

A SentencePiece BPE tokenizer of 1000 ids (the format torchtune's llama2_tokenizer reads; the
llama3 and qwen tokenizers have special ids past 100000, which would need a huge vocabulary),
trained on a synthetic corpus; a random state dict of the configs' 2-layer llama2 (780,928
parameters) in the format FullModelTorchTuneCheckpointer reads; and alpaca-style records.
"""

import json
import random
import sys
from pathlib import Path


def write_assets(folder: Path, records: int = 200) -> None:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vo", "ne", "di", "po", "ar", "el", "in", "os", "ul"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(800)})

    def sentence() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(5, 18))).capitalize() + "."

    folder.mkdir(parents=True, exist_ok=True)
    data = [{"instruction": sentence(), "input": rng.choice(["", sentence()]),
             "output": " ".join(sentence() for _ in range(rng.randint(1, 4)))} for _ in range(records)]
    (folder / "alpaca.json").write_text(json.dumps(data))
    (folder / "corpus.txt").write_text("\n".join(" ".join(sentence() for _ in range(8)) for _ in range(400)))

    import sentencepiece
    import torch
    from torchtune.models.llama2 import llama2

    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"), vocab_size=1000, model_type="bpe",
        character_coverage=1.0, byte_fallback=True,  # byte_fallback: any text encodes
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    torch.manual_seed(0)
    model = llama2(vocab_size=1000, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, max_seq_len=512)
    (folder / "ckpt").mkdir(exist_ok=True)
    torch.save(model.state_dict(), folder / "ckpt" / "model.pt")


if __name__ == "__main__":
    write_assets(Path(sys.argv[1]))
