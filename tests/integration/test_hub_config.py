"""--hf-config with a Hub model id: only its config.json, from the Hugging Face cache, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.optional import needs

pytestmark = needs("huggingface_hub")  # every test reads the Hub cache through it

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
          "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16"}


def _cache(root: Path, repo: str) -> Path:
    """A cache laid out the way huggingface_hub writes it: refs/main names a snapshot."""
    folder = root / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    return root


def _graphmem(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "graphmem", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@needs("transformers")
def test_a_hub_id_reads_the_cached_config_and_names_the_class(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "hub", "someorg/tiny-llama")
    done = _graphmem(["analyze", "--hf-config", "someorg/tiny-llama", "--input", "input_ids=1x16:int64",
                      "--mode", "inference", "--format", "json"], cache)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["target"] == "LlamaForCausalLM (from someorg/tiny-llama)"
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in CONFIG.items()
                                                                       if k not in ("architectures", "torch_dtype")}))
    params = sum(p.numel() for p in model.parameters()) * torch.bfloat16.itemsize  # the config's torch_dtype
    assert data["inference"]["params_bytes"] == params


def test_a_hub_id_not_in_the_cache_is_one_clear_line(tmp_path: Path) -> None:
    done = _graphmem(["analyze", "--hf-config", "someorg/not-cached", "--input", "input_ids=1x16:int64"],
                     tmp_path / "empty")
    assert done.returncode == 2
    assert "not in the Hugging Face cache" in done.stderr and "Traceback" not in done.stderr
