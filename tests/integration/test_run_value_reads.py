"""graphmem run: every way Python reads a tensor's values works as on a real tensor (issue 45).

Each program trains a tiny model for two optimizer steps and, after the first, reads the loss (a
value computed from the weights, which graphmem does not know: taken as 0 and listed under the
report's assumptions with the program's line) and a tensor made from data (its real values kept:
the program asserts them exactly).  Where memory is at stake (a deep copy, sparse tensors,
Lightning's ``self.log``), the peak is compared with the same program run for real
(tests/oracles.py's ``measure_program``)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tests.oracles as oracles
from graphmem import run_program
from graphmem.cli import main
from tests.oracles import measure_program

_PROGRAM = '''\
import contextlib
import copy
import io
import math

import numpy as np
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
data = torch.tensor([1.5, 2.5])
for step in range(2):
    out = model(x)
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
{loss_read}
{data_read}
'''

# form -> (a read of the loss or the model's output, a read of the data that asserts its real
# values); the report's note names the loss read's line
FORMS: dict[str, tuple[str, str]] = {
    "item": ("print(loss.item())", "assert data.sum().item() == 4.0"),
    "float": ("print(float(loss))", "assert float(data.sum()) == 4.0"),
    "int": ("print(int(loss))", "assert int(data.sum()) == 4"),
    "bool": ("print(bool(loss))", "assert bool(data.sum()) and not bool(data.sum() - 4)"),
    "index": ("print([10, 11, 12][loss.long()])", "assert [10, 11, 12, 13, 14][data.sum().long()] == 14"),
    "format": ('print(f"step {step}: train loss {loss:.4f}")',
               'assert f"{data.sum():.4f} {data[0]:>8.2f}" == "4.0000     1.50"'),
    "str": ("print(str(loss))", 'assert str(data) == "tensor([1.5000, 2.5000])"'),
    "repr": ("print(repr(loss))", 'assert repr(data * 2) == "tensor([3., 5.])"'),
    "print": ("print(loss)", 'with contextlib.redirect_stdout(io.StringIO()) as text:\n    print(data)\n'
                             'assert text.getvalue() == "tensor([1.5000, 2.5000])\\n"'),
    "tolist": ("print(out.tolist())", "assert data.tolist() == [1.5, 2.5]"),
    "numpy": ("print(out.detach().numpy().sum())", "assert data.numpy().tolist() == [1.5, 2.5]"),
    "asarray": ("print(np.asarray(out.detach()).shape)",
                "assert np.asarray(data, dtype=np.float64).tolist() == [1.5, 2.5]"),
    "math_exp": ("print(math.exp(loss))", "assert math.exp(data[0]) == math.exp(1.5)"),
    "math_isnan": ("print(math.isnan(loss), math.isfinite(loss))", "assert not math.isnan(data[1])"),
    "if": ("if loss > 0.5:\n    print('high loss')", "if data[0] > 2:\n    raise AssertionError('data[0] is 1.5')"),
    "while": ("n = 0\nwhile loss > n and n < 3:\n    n += 1", "n = 0\nwhile data[1] > n:\n    n += 1\nassert n == 3"),
    "max": ("print(max(loss, torch.tensor(0.1)))", "assert float(max(data[0], data[1])) == 2.5"),
    "equal": ("print(torch.equal(loss, loss.detach().clone()), torch.allclose(out, out))",
              "assert torch.equal(data, torch.tensor([1.5, 2.5])) and not torch.equal(data, data + 1)"),
    "sorted": ("print(sorted([loss, loss * 2]))",
               "assert [float(v) for v in sorted([data[1], data[0]])] == [1.5, 2.5]"),
    "isfinite": ("if not torch.isfinite(loss).all():\n    raise SystemExit('loss is not finite')",
                 "assert torch.isfinite(data).all() and not torch.isnan(data).any()"),
    "len_iter": ("print(len(out), [float(v) for v in out[0, :2]])",
                 "assert len(data) == 2 and [float(v) for v in data] == [1.5, 2.5]"),
    "deepcopy": ("print(copy.deepcopy(loss.detach()))",
                 "kept = copy.deepcopy(data)\nkept += 1\n"
                 "assert kept.tolist() == [2.5, 3.5] and data.tolist() == [1.5, 2.5]"),
}
# the forms whose loss read is no value taken as 0: isfinite's (a run that trains has finite
# values, as analyze takes them; noted with the line that decided on it)
_NO_READ = frozenset({"isfinite"})


def _program(folder: Path, form: str) -> tuple[Path, int]:
    """The program for ``form`` and the line of its loss read (its first line naming the loss or
    the model's output)."""
    loss_read, data_read = FORMS[form]
    text = _PROGRAM.format(loss_read=textwrap.indent(loss_read, " " * 4), data_read=textwrap.indent(data_read, " " * 4))
    script = folder / f"reads_{form}.py"
    script.write_text(text)
    read = next(line for line in loss_read.splitlines() if "loss" in line or "out" in line)
    return script, text.splitlines().index(" " * 4 + read) + 1


@pytest.mark.parametrize("form", list(FORMS))
def test_each_way_python_reads_a_value(tmp_path: Path, form: str) -> None:
    """The program runs to its second step; the data's values read back exactly (the program
    asserts them); the loss's, unknown, are noted with the program's line."""
    script, line = _program(tmp_path, form)
    report = run_program(str(script), steps=2)
    assert report.program_failed is None, report.program_failed  # (its asserts held)
    assert report.train is not None and report.train.peak_bytes > 0
    taken = [note for note in report.train.assumptions if "taken as 0" in note]
    at = f"{script.name}:{line}"
    if form in _NO_READ:
        assert not taken, taken
        assert any("for NaN or inf, taken as finite: `if not torch.isfinite(loss).all():` at " in note and at in note
                   for note in report.train.assumptions), report.train.assumptions
    else:
        assert any(at in note for note in taken), (at, taken)
        assert all(at in note for note in taken), taken  # the data's reads noted nothing


def test_the_nanogpt_log_line_through_the_command(tmp_path: Path) -> None:
    """karpathy/nanoGPT's ``print(f"step {iter_num}: train loss {losses['train']:.4f}")`` on a
    0-dim tensor: the command exits 0 and names the line it read as 0."""
    script = tmp_path / "nanogpt_log.py"
    script.write_text(textwrap.dedent('''\
        import torch
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        for iter_num in range(3):
            losses = {"train": torch.nn.functional.mse_loss(model(x), y)}
            print(f"step {iter_num}: train loss {losses['train']:.4f}")
            losses["train"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        '''))
    result = CliRunner().invoke(main, ["run", str(script)])
    assert result.exit_code == 0, result.output
    assert "step 0: train loss 0.0000" in result.output
    assert "nanogpt_log.py:7 read as 0.0" in " ".join(result.output.split()), result.output


def _equal(script: Path, argv: list[str] | None = None) -> int:
    real = measure_program(str(script), argv or [], 2)
    report = run_program(str(script), argv or [], steps=2)
    assert report.program_failed is None, report.program_failed
    predicted = report.train
    assert predicted is not None
    assert predicted.peak_bytes == real.peak_bytes
    assert list(predicted.iteration_peaks) == [real.phase_peaks["step 1"], real.phase_peaks["step 2"]]
    return predicted.peak_bytes


def test_deep_copies_equal_the_real_run(tmp_path: Path) -> None:
    """``copy.deepcopy`` of tensors made from data (a 0-dim state, as torchmetrics' ``add_state``
    copies its default; a view, whose copy is its whole storage's, as torch copies it) and of a
    buffer-holding module: the copies' values are the data's, and the peak is the real run's."""
    script = tmp_path / "copies.py"
    script.write_text(textwrap.dedent('''\
        import copy
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 16)
        state, table = torch.tensor(0.0), torch.arange(64, dtype=torch.float32)
        kept = []
        for step in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            total = copy.deepcopy(state)
            total += 3
            assert float(total) == 3.0 and float(state) == 0.0
            part = copy.deepcopy(table[8:12])  # its storage: all 64 elements
            assert part.tolist() == [8.0, 9.0, 10.0, 11.0]
            kept.append((total, part, copy.deepcopy(model)))
        '''))
    _equal(script)


@pytest.fixture
def counting_sparse_parts() -> Iterator[None]:
    """tests/oracles.py's live-storage count, with a sparse tensor counted by the storages of its
    parts (its own has none: ``untyped_storage()`` refuses it)."""
    counter = oracles.LiveStorages

    class SparseParts(counter):  # type: ignore[misc,valid-type]
        def add(self, t: object) -> None:
            if isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo:
                pieces: tuple[torch.Tensor, ...] = (t._indices(), t._values())
            elif isinstance(t, torch.Tensor) and t.layout in (torch.sparse_csr, torch.sparse_bsr):
                pieces = (t.crow_indices(), t.col_indices(), t.values())
            elif isinstance(t, torch.Tensor) and t.layout in (torch.sparse_csc, torch.sparse_bsc):
                pieces = (t.ccol_indices(), t.row_indices(), t.values())
            else:
                pieces = (t,)  # type: ignore[assignment]
            for piece in pieces:
                super().add(piece)

    oracles.LiveStorages = SparseParts  # type: ignore[misc]
    try:
        yield
    finally:
        oracles.LiveStorages = counter  # type: ignore[misc]


def test_sparse_data_equals_the_real_run(tmp_path: Path, counting_sparse_parts: None) -> None:
    """A program that keeps its data sparse (COO and CSR, converted while it loads, as a graph's
    adjacency) and densifies each batch: each sparse tensor counted by its indices and values,
    as many as the data has, to the byte of the real run.  By hand: 22 rows x 7 columns set,
    154 elements; COO: 2 x 154 int64 indices (2,464 B) + 154 float32 values (616 B); CSR: 65
    row offsets (520 B), its column indices on a 2 x 154 storage (2,464 B), values (616 B)."""
    script = tmp_path / "sparse.py"
    script.write_text(textwrap.dedent('''\
        import torch
        data = torch.zeros(64, 32)
        data[::3, ::5] = 1.0
        coo, csr = data.to_sparse(), data.to_sparse_csr()
        assert coo._nnz() == csr._nnz() == 154
        model = torch.nn.Linear(32, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            batch = coo.to_dense() if step % 2 == 0 else csr.to_dense()
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        '''))
    peak = _equal(script)
    without = tmp_path / "dense.py"  # the same program keeping no sparse copies
    without.write_text(script.read_text().replace("coo, csr = data.to_sparse(), data.to_sparse_csr()\n"
                                                  "assert coo._nnz() == csr._nnz() == 154\n", "")
                       .replace("coo.to_dense() if step % 2 == 0 else csr.to_dense()", "data.clone()"))
    dense = run_program(str(without), steps=2)
    assert dense.program_failed is None and dense.train is not None
    assert peak - dense.train.peak_bytes == 2464 + 616 + 520 + 2464 + 616


def test_sparse_made_from_the_models_values_is_bounded(tmp_path: Path) -> None:
    """A sparse copy of a weight (values graphmem does not know): kept at the most elements it can
    have, every element, and noted as an upper bound."""
    script = tmp_path / "sparse_weights.py"
    script.write_text(textwrap.dedent('''\
        import torch
        model = torch.nn.Linear(32, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            pruned = model.weight.detach().to_sparse()
            print(pruned._nnz())
        '''))
    report = run_program(str(script), steps=2)
    assert report.program_failed is None and report.train is not None
    assert any("upper bound: to_sparse depends on values; recorded keeping 256 elements, the most it can" in note
               for note in report.train.assumptions), report.train.assumptions


def test_lightning_logging_equals_the_real_run(tmp_path: Path) -> None:
    """A LightningModule calling ``self.log("train_loss", loss)`` and, validating after each step,
    ``self.log("val_loss", ...)`` (Lightning keeps each logged value in torchmetrics-style state it
    deep-copies): runs, and equals the real run to the byte, each step."""
    pytest.importorskip("lightning")  # imported before both: its import-time tensors count in neither
    script = tmp_path / "lightning_log.py"
    script.write_text(textwrap.dedent('''\
        import lightning as L
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset

        class Regressor(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.mse_loss(self.net(x), y)
                self.log("train_loss", loss)
                return loss

            def validation_step(self, batch, batch_idx):
                x, y = batch
                self.log("val_loss", F.mse_loss(self.net(x), y))

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        torch.manual_seed(0)
        data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, val_check_interval=1, limit_val_batches=2)
        trainer.fit(Regressor(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
        '''))
    _equal(script)


def test_torchmetrics_state_equals_the_real_run(tmp_path: Path) -> None:
    """A torchmetrics metric (``add_state`` deep-copies its ``torch.tensor(0.0)`` default) updated
    with each step's loss and computed: runs, and equals the real run to the byte."""
    pytest.importorskip("torchmetrics")
    script = tmp_path / "metric.py"
    script.write_text(textwrap.dedent('''\
        import torch
        import torchmetrics
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mean_loss = torchmetrics.MeanMetric()
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        for step in range(2):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean_loss.update(loss.detach())
            print(f"mean loss {mean_loss.compute():.4f}")
        '''))
    _equal(script)


def test_a_batch_fetched_between_micro_steps_reads_its_data(tmp_path: Path) -> None:
    """nanoGPT's loop: with gradient accumulation the next batch is fetched after a backward pass
    (the backward phase lasts to the last micro-batch), sliced out of a numpy array at positions
    drawn as a tensor (``data[i:i + 32]``, ``i`` a 0-dim tensor, read by ``__index__``): the
    positions are the data's, so each batch is 4 x 32 tokens (it was 4 x 0: ``i + 32``, computed
    in that phase, was not followed and read as 0), and the peak is the real run's."""
    script = tmp_path / "accumulate.py"
    script.write_text(textwrap.dedent('''\
        import numpy as np
        import torch
        import torch.nn.functional as F
        emb, head = torch.nn.Embedding(30, 32), torch.nn.Linear(32, 30)
        opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()], lr=1e-3)
        data = np.arange(4096, dtype=np.uint16) % 30

        def get_batch():
            ix = torch.randint(4000, (4,))
            x = torch.stack([torch.from_numpy((data[i:i + 32]).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy((data[i + 1:i + 33]).astype(np.int64)) for i in ix])
            assert x.shape == y.shape == (4, 32), x.shape
            return x, y

        X, Y = get_batch()
        for step in range(2):
            for micro_step in range(2):
                logits = head(emb(X))
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1), ignore_index=-1) / 2
                X, Y = get_batch()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        '''))
    _equal(script)
