"""The Slurm launch recipe in docs/preflight.md runs under ``set -euo pipefail`` as written:
it submits the largest batch that fits, takes the "even batch 1 does not fit" branch (plan,
exit 1), and stops on a failed analysis with its message.  The model, sizes and budget are
swapped for small ones; ``sbatch`` is a stub that prints what it was asked to run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("jq") is None or shutil.which("bash") is None,
                                reason="the recipe needs bash and jq")


def _recipe() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "preflight.md").read_text(), re.S)
    script = next(b for b in blocks if "launch.sh" in b)
    assert "set -euo pipefail" in script
    return script


def _run(tmp_path: Path, model: str, budget: str) -> subprocess.CompletedProcess[str]:
    script = _recipe().replace("MODEL=train.py:build_model", f"MODEL={model}").replace("2048", "64")
    script = script.replace("--amp bf16 --gpu h100-80gb --margin 8%", f"--budget {budget}")
    (tmp_path / "bin").mkdir(exist_ok=True)
    stub = tmp_path / "bin" / "sbatch"
    stub.write_text('#!/bin/sh\necho "sbatch stub: $*"\n')
    stub.chmod(0o755)
    (tmp_path / "launch.sh").write_text(script)
    path = os.pathsep.join([str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(["bash", str(tmp_path / "launch.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PATH": path}, timeout=600)


def test_submits_the_largest_batch_that_fits(tmp_path: Path) -> None:
    done = _run(tmp_path, "examples/gpt.py:GPT", "64MiB")
    assert done.returncode == 0, done.stderr
    submitted = re.search(r"--micro-batch (\d+)", done.stdout)
    assert submitted is not None and int(submitted.group(1)) >= 1 and "sbatch stub" in done.stdout


def test_even_batch_1_does_not_fit_prints_the_plan_and_exits_1(tmp_path: Path) -> None:
    done = _run(tmp_path, "examples/gpt.py:GPT", "1KiB")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "even batch 1 does not fit" in done.stdout and "graphmem plan" in done.stdout
    assert "sbatch stub" not in done.stdout


def test_a_failed_analysis_stops_with_its_message(tmp_path: Path) -> None:
    done = _run(tmp_path, "examples/nosuch.py:GPT", "64MiB")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "max-batch failed: " in done.stdout and "nosuch.py" in done.stdout
    assert "sbatch stub" not in done.stdout
