"""graphmem run against the same program run for real (tests/oracles.py: live storages counted op
by op from the program's first line to the end of its K-th optimizer step): the peak and each
step's peak to the byte."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphmem import run_program
from graphmem.cli import main
from graphmem.report.header import parameter_count
from tests.conftest import ROOT
from tests.oracles import measure_program, save_tiny_gpt2

PROGRAMS = ROOT / "tests" / "programs"



def _equal(script: Path, argv: list[str], steps: int = 2) -> None:
    real = measure_program(str(script), argv, steps)
    predicted = run_program(str(script), argv, steps=steps).train
    assert predicted is not None
    assert predicted.peak_bytes == real.peak_bytes
    assert list(predicted.iteration_peaks) == [real.phase_peaks[f"step {k + 1}"] for k in range(steps)]


def test_plain_loop_that_prefetches_the_next_batch() -> None:
    """The next batch is fetched between the forward and the backward: two batches live."""
    _equal(ROOT / "examples" / "train_loop.py", ["--batch-size", "32", "--hidden", "1024"])


def test_program_keeping_its_own_tensors() -> None:
    """A CPU cache of logits, clip_grad_norm_, a schedule, an evaluation forward, SGD momentum."""
    _equal(PROGRAMS / "own_tensors.py", ["--batch-size", "8"], steps=3)


def test_memory_that_depends_on_the_programs_own_data() -> None:
    """Batches cut to their longest sequence (``int(mask.sum(-1).max())``) and the tokens that
    are not padding picked by a boolean mask: the sizes come from the program's data, which
    graphmem run computes for real (a DataLoader's seed too): each step's peak differs, and
    equals the real run's, with no value taken as 0."""
    _equal(PROGRAMS / "real_data.py", [], steps=3)
    report = run_program(str(PROGRAMS / "real_data.py"), [], steps=3).train
    assert report is not None and not any("taken as 0" in note for note in report.assumptions)
    assert len(set(report.iteration_peaks)) == 3


def test_accelerate_loop() -> None:
    """A loop written for accelerate (Accelerator.prepare of model, optimizer and a shuffled
    DataLoader; accelerator.backward), as `accelerate launch` runs it on one process."""
    pytest.importorskip("accelerate")  # imported before both: its import-time tensors count in neither
    _equal(PROGRAMS / "accelerate_loop.py", [])


def test_fine_tuning_from_a_checkpoint(tmp_path: Path) -> None:
    """from_pretrained of a safetensors checkpoint, then AdamW steps: safetensors memory-maps
    the file and the parameters are those mappings, which PyTorch's allocator never allocated
    (graphmem counts them as 0); the real run's count has them, as every storage an op reads.
    Nothing else differs, step by step: transformers' loading threads are not left out."""
    pytest.importorskip("transformers")
    folder, params = save_tiny_gpt2(tmp_path / "checkpoint")
    script = str(PROGRAMS / "from_pretrained.py")
    real = measure_program(script, [str(folder)], 2)
    predicted = run_program(script, [str(folder)], steps=2).train
    assert predicted is not None and predicted.params_bytes == 0
    assert [real.phase_peaks[f"step {k + 1}"] - params for k in range(2)] == list(predicted.iteration_peaks)
    # the header still counts them: mapped, not absent
    assert parameter_count(predicted) == {"float32": params // 4}


def test_hf_trainer_script(tmp_path: Path) -> None:
    """transformers' Trainer (loss only kept, logits freed before backward), max_steps=2."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers.trainer")  # imported before both: its import-time tensors count in neither
    _equal(PROGRAMS / "hf_trainer.py", [str(tmp_path / "out")])


def test_lightning_trainer_fit() -> None:
    """Lightning's Trainer.fit (its own loop, closure-based optimizer step, an MSE loss)."""
    pytest.importorskip("lightning")  # imported before both: its import-time tensors count in neither
    _equal(PROGRAMS / "lightning_fit.py", [])


def test_module_form_runs_as_python_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-m MODULE: found from the working folder, as python -m finds it; the same bytes as the script."""
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((ROOT / "examples" / "train_loop.py").read_text())
    monkeypatch.chdir(tmp_path)
    argv = ["--batch-size", "4", "--hidden", "256"]
    real = measure_program(str(package / "train.py"), argv, 2)
    predicted = run_program("trainpkg.train", argv, module=True).train
    assert predicted is not None and predicted.peak_bytes == real.peak_bytes


def test_fewer_steps_than_asked_are_reported() -> None:
    report = run_program(str(ROOT / "examples" / "train_loop.py"), ["--steps", "1", "--hidden", "64"], steps=3)
    assert report.train is not None
    assert any("ended after 1 step" in note for note in report.train.assumptions)
    real = measure_program(str(ROOT / "examples" / "train_loop.py"), ["--steps", "1", "--hidden", "64"], 3)
    assert report.train.peak_bytes == real.peak_bytes


def _cli(*args: str) -> tuple[int, str, str]:
    """Exit code, standard output (the report), both streams (the program prints to stderr)."""
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.output


def test_cli_json_names_the_program_and_its_model() -> None:
    code, out, both = _cli("run", "--format", "json", str(ROOT / "examples" / "train_loop.py"), "--hidden", "64")
    assert code == 0, both
    data = json.loads(out)
    assert data["program"].endswith("train_loop.py --hidden 64") and data["target"] == "Sequential"
    real = measure_program(str(ROOT / "examples" / "train_loop.py"), ["--hidden", "64"], 2)
    assert data["train"]["peak_bytes"] == real.peak_bytes


def test_logging_services_are_off_for_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program runs with Weights & Biases disabled (wandb reads WANDB_MODE: its runs log and
    send nothing); graphmem's own environment is as it was."""
    script = tmp_path / "logs.py"
    script.write_text("import os\nimport torch\n"
                      "assert os.environ['WANDB_MODE'] == 'disabled', os.environ.get('WANDB_MODE')\n"
                      "w = torch.nn.Parameter(torch.ones(4))\nopt = torch.optim.SGD([w], lr=0.1)\n"
                      "for _ in range(2):\n    (w * 2).sum().backward()\n    opt.step()\n")
    monkeypatch.setenv("WANDB_MODE", "online")
    report = run_program(str(script)).train
    assert report is not None and report.peak_bytes > 0
    assert os.environ["WANDB_MODE"] == "online"


def test_cli_errors() -> None:
    code, _, out = _cli("run", str(PROGRAMS / "raises.py"))
    assert code == 3 and "raised ValueError: the data folder is missing after 1 optimizer step" in out, out
    assert "raises.py:7" in out and "Traceback" not in out
    code, _, out = _cli("run", str(PROGRAMS / "exits.py"))
    assert code == 3 and "before its first optimizer step: nothing to analyse" in out, out
    code, _, out = _cli("run", "no/such/train.py")
    assert code == 2 and "no such program" in out, out
    code, _, out = _cli("run")
    assert code == 2 and "give the program to run" in out, out
    assert sys.argv[0] != "no/such/train.py"  # the program's argv does not leak into graphmem's


def test_an_error_raised_inside_a_library_names_the_programs_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A library raising deep inside (transformers, offline, asked for a model it has not
    cached): the program's own line that called it, then the library's line that raised; none
    of the library's frames between them, none of Python's own."""
    pytest.importorskip("transformers")
    script = tmp_path / "offline.py"
    script.write_text("import json\nfrom transformers import AutoConfig\n\n"
                      "json.dumps({})\nconfig = AutoConfig.from_pretrained('no-such-org/no-such-model')\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, _, out = _cli("run", str(script))
    assert code == 3 and "raised OSError" in out, out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  /") or line.startswith("  offline")]
    assert lines[0].endswith("offline.py:5: config = AutoConfig.from_pretrained('no-such-org/no-such-model')"), out
    assert len(lines) == 2 and "/transformers/" in lines[1], out  # the one line of the library's that raised


def test_program_doing_what_analyze_does_gives_analyzes_bytes() -> None:
    """tests/programs/analyze_step.py writes out the step analyze records for examples/mlp.py:MLP."""
    from graphmem import analyze

    job = analyze("examples/mlp.py:MLP", ["32x1000"], mode="train", optimizer="adam").train
    run = run_program(str(PROGRAMS / "analyze_step.py")).train
    assert job is not None and run is not None
    assert run.peak_bytes == job.peak_bytes and run.iteration_peaks == job.iteration_peaks


def test_budget_is_a_gate_on_the_real_peak() -> None:
    """--budget: exit 0 at the real run's peak, 1 one byte below it, as graphmem check."""
    script, argv = str(ROOT / "examples" / "train_loop.py"), ["--batch-size", "8", "--hidden", "512"]
    real = measure_program(script, argv, 2).peak_bytes
    for budget, code, word in ((real, 0, "FITS"), (real - 1, 1, "DOES NOT FIT")):
        result = CliRunner().invoke(main, ["run", "--budget", f"{budget}B", script, *argv])
        assert result.exit_code == code, result.output
        assert f"\n{word}:" in result.output
    as_json = CliRunner().invoke(main, ["run", "--format", "json", "--budget", f"{real}B", script, *argv])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["check"]["fits"] is True


def test_checkpoint_saves_are_skipped_and_listed(tmp_path: Path) -> None:
    """torch.save between the steps writes nothing (and costs nothing: the real run's peak is
    the prediction); each save is listed with the program's line."""
    script = PROGRAMS / "saves.py"
    (tmp_path / "real").mkdir()
    real = measure_program(str(script), [str(tmp_path / "real")], 3)
    predicted = run_program(str(script), [str(tmp_path)], steps=3).train
    assert predicted is not None and predicted.peak_bytes == real.peak_bytes
    assert not list(tmp_path.glob("step*.pt"))
    skipped = [a for a in predicted.assumptions if "checkpoint save was skipped" in a]
    assert len(skipped) == 2 and all("saves.py:17" in a for a in skipped)  # after steps 1 and 2


def test_the_peak_and_each_top_tensor_name_the_programs_line() -> None:
    """The peak of examples/train_loop.py is in the optimizer step: its line is `opt.step()`;
    a gradient is made by `loss.backward()`, a parameter by the model's construction."""
    result = CliRunner().invoke(main, ["run", "--format", "json", "examples/train_loop.py", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    train = json.loads(result.stdout)["train"]

    def source(line: str) -> str:
        path, number = line.rsplit(":", 1)
        return (ROOT / path).read_text().splitlines()[int(number) - 1].strip()

    assert train["peak"]["phase"] == "optimizer" and source(train["peak"]["line"]) == "opt.step()"
    made = {t["category"]: source(t["line"]) for t in train["top_tensors"] if "line" in t}
    assert made["gradients"] == "loss.backward()" and made["parameters"].startswith("model = nn.Sequential(")


@pytest.mark.slow  # waits out --timeout 10
def test_a_program_that_never_steps_is_stopped_by_timeout_naming_its_line() -> None:
    """--timeout: exit 3, and the error names the program's line it was running."""
    import subprocess

    script = PROGRAMS / "never_steps.py"
    done = subprocess.run([sys.executable, "-m", "graphmem", "run", "--timeout", "10", str(script)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert "timed out after 10" in done.stderr and "never_steps.py:10" in done.stderr


def test_a_loop_that_updates_by_hand() -> None:
    """No torch.optim optimizer: each step is a backward pass and the update after it; all three
    steps recorded equal the real run (which runs to its end), and --steps 2 stops before the third
    forward."""
    script = str(PROGRAMS / "by_hand.py")
    real = measure_program(script, [], 99)  # no optimizer step ever stops it: the whole run
    three = run_program(script, steps=3).train
    assert three is not None and three.peak_bytes == real.peak_bytes and len(three.iteration_peaks) == 3
    assert any("updates its parameters itself" in note for note in three.assumptions)
    two = run_program(script, steps=2).train
    assert two is not None and len(two.iteration_peaks) == 2
    assert not any(op.iteration == 2 for op in two.trace.ops)


def test_the_per_module_table_of_a_program_counts_its_parameters() -> None:
    """graphmem run's per-module table fills the parameters column as analyze's does: each
    Linear of examples/train_loop.py holds its weight and bias, float32 (counted here from
    the sizes the script builds: 1000 -> 256 -> 1000)."""
    from graphmem.report.modules import module_rows

    report = run_program(str(ROOT / "examples" / "train_loop.py"), ["--batch-size", "8", "--hidden", "256"]).train
    assert report is not None
    rows = {row.module: row.params_bytes for row in module_rows(report, depth=1)}
    assert rows["0"] == (1000 * 256 + 256) * 4 and rows["2"] == (256 * 1000 + 1000) * 4
    assert sum(rows.values()) == report.params_bytes


def test_lbfgs_with_its_closure() -> None:
    """optimizer.step(closure) of LBFGS: the closure runs inside the step as often as LBFGS asks,
    its loss values unknown to graphmem: taken as falling each time, so the step runs every
    iteration max_iter allows, which is what this real run does (20 calls a step). The first
    step equals the real run to the byte; in the second the real history keeps a few more
    direction pairs than the one graphmem's stand-in values build (each 2 x 321 floats): the
    prediction is at most 2% below, and says how many calls it took."""
    script = str(PROGRAMS / "lbfgs.py")
    real = measure_program(script, [], 2)
    predicted = run_program(script, steps=2).train
    assert predicted is not None
    assert predicted.iteration_peaks[0] == real.phase_peaks["step 1"]
    assert 0.98 * real.phase_peaks["step 2"] <= predicted.iteration_peaks[1] <= real.phase_peaks["step 2"]
    assert any("closure 40 times over 2 steps" in note for note in predicted.assumptions)


def test_a_tensor_over_the_programs_bytes_is_not_allocated() -> None:
    """torch.frombuffer (torchvision's MNIST reading its files) shares the buffer's memory: the
    real run allocates nothing for it, and graphmem run neither (it counted the whole buffer)."""
    _equal(PROGRAMS / "frombuffer.py", [])
