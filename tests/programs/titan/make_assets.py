"""Tiny local assets for tests/programs/titan (nothing downloaded):

    python make_assets.py DIR    writes DIR/tokenizer/{tokenizer.json,tokenizer_config.json}
                                 and DIR/c4_test/data.json

A byte-level BPE tokenizer (Hugging Face ``tokenizers``, at most 2000 ids: the debugmodel's
vocabulary is 2048 and is not resized to it) trained on a synthetic corpus, and that corpus
as JSON lines with a "text" field, the c4_test format torchtitan loads with ``datasets``.
"""

import json
import random
import sys
from pathlib import Path


def write_assets(folder: Path, documents: int = 300) -> None:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vo", "ne", "di", "po", "ar", "el", "in", "os", "ul"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(800)})
    words += ["the", "a", "of", "and", "to", "in", "is"] * 20

    def sentence() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(5, 18))).capitalize() + "."

    docs = [" ".join(sentence() for _ in range(rng.randint(3, 25))) for _ in range(documents)]
    (folder / "c4_test").mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    (folder / "c4_test" / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    # torchtitan's HuggingFaceTokenizer reads its begin and end tokens from here
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": specials[0], "eos_token": specials[1], "pad_token": specials[2],
         "add_bos_token": True, "add_eos_token": False}))


if __name__ == "__main__":
    write_assets(Path(sys.argv[1]))
