"""Issue 33's reference case through the CLI: Llama-3-8B (bf16), AdamW, one sequence of 4096
tokens on one H100.  Its allocated peak fits the GPU, its reserved peak does not: not FITS
(exit 1), and with expandable segments, which the verdict names and analyses, it fits."""

from __future__ import annotations

import re

from click.testing import CliRunner

from graphmem.cli import main
from tests.optional import needs

pytestmark = needs("transformers")  # --preset llama-3-8b is a transformers class

ARGS = ["check", "--preset", "llama-3-8b", "--input", "input_ids=1x4096:int64", "--input", "labels=1x4096:int64",
        "--optimizer", "adamw", "--gpu", "h100-80gb"]


def _headrooms(text: str) -> tuple[str, str]:
    """The headroom of the allocated and of the reserved peak (with the CUDA context)."""
    found = [re.search(rf"^{kind} \+ CUDA context +\S+ \S+ +(\S+ \S+)$", text, re.M) for kind in ("allocated",
                                                                                                   "reserved")]
    assert found[0] and found[1], text
    return found[0][1], found[1][1]


def test_llama_3_8b_on_one_h100_does_not_fit_until_segments_expand() -> None:
    result = CliRunner().invoke(main, ARGS)
    assert result.exit_code == 1, result.output
    flat = " ".join(result.output.split())
    allocated, reserved = _headrooms(result.output)
    assert not allocated.startswith("-") and reserved.startswith("-")  # the tensors fit, the segments do not
    assert "DOES NOT FIT: the reserved peak + CUDA context is short by" in flat and "FITS:" not in flat
    remedy = flat.split("Remedy: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--alloc-conf "
                        "expandable_segments:True), analysed:")[1]
    assert ": fits with" in remedy

    applied = CliRunner().invoke(main, [*ARGS, "--alloc-conf", "expandable_segments:True"])
    assert applied.exit_code == 0, applied.output
    assert "FITS:" in applied.output and "expandable_segments:True (from --alloc-conf)" in applied.output
    assert not _headrooms(applied.output)[1].startswith("-")
