"""benchmarks/gpu_validate.py stays runnable without a GPU: import-safe, and --dry-run runs
the real step on CPU and writes its page (the CUDA measurement itself needs a GPU)."""

from __future__ import annotations

import importlib
from pathlib import Path


def test_dry_run_writes_the_table(tmp_path: Path) -> None:
    script = importlib.import_module("benchmarks.gpu_validate")  # import runs no CUDA call
    out = tmp_path / "accuracy-gpu.md"
    # the whole programs and the generation row take minutes on 2 cores: left out here
    assert script.main(["--dry-run", "--models", "mlp", "--configs", "train-fp32-sgd", "--programs", "none",
                        "--write", str(out)]) == 0
    text = out.read_text()
    assert "| model | config | predicted allocated (B) | measured allocated (B) | error |" in text
    assert "| mlp | train-fp32-sgd |" in text
    assert "Dry run on CPU" in text
    assert "measure:" not in text  # the step itself ran on CPU without error
    assert "| expandable_segments:True | 2000 | n/a (dry run) |" in text  # the allocator-only section


def test_error_column_by_hand() -> None:
    script = importlib.import_module("benchmarks.gpu_validate")
    # (110 - 100) / 100 = +10.00%; a missing side gives n/a
    assert script._error(110, 100) == "+10.00%"
    assert script._error(None, 100) == "n/a"
