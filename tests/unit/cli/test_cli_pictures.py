"""Every picture option is checked before the analysis: a rendered ``--dot`` graph without
Graphviz's ``dot`` program on PATH is refused at once, as a usage error (exit 2, docs/exit-codes.md),
before TARGET is imported (no torch even), and none of the pictures asked with it is written
(docs/visualisation.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.optional import needs

# the model's file says when it is imported: the refusal must come before
MODEL = textwrap.dedent("""
    from pathlib import Path

    Path(__file__).with_name("imported").write_text("the model's module was imported")

    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x)
""")
PICTURES = ["--timeline", "out/t.svg", "--snapshot", "out/s.pickle", "--html", "out/p.html"]


@needs("pydot", "matplotlib")
@pytest.mark.parametrize("dot_first", [True, False], ids=["dot-first", "dot-last"])
@pytest.mark.parametrize("suffix", ["png", "svg", "pdf"])
def test_a_rendered_graph_without_graphviz_is_refused_before_the_analysis(tmp_path: Path, dot_first: bool,
                                                                          suffix: str) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "out").mkdir()
    (tmp_path / "bin").mkdir()  # PATH: this empty folder alone, so no Graphviz
    dot = ["--dot", f"out/g.{suffix}"]
    args = ["analyze", "model.py:Net", "--input", "2x4", *(dot + PICTURES if dot_first else PICTURES + dot)]
    env = {**os.environ, "PATH": str(tmp_path / "bin")}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "graphmem", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported  # nothing was analysed: not even torch was imported
    assert not (tmp_path / "imported").exists()
    message = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert message == [f"Error: Invalid value for '--dot': writing a .{suffix} graph needs Graphviz's `dot` "
                       "program, which is not on PATH; install Graphviz (apt-get install graphviz, brew install "
                       "graphviz) or write a .dot file"]
    assert done.stdout == ""
    assert os.listdir(tmp_path / "out") == []  # none of the pictures, no partial file
