"""graphmem.report.files: output paths checked before the analysis; files whole or absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import graphmem.report.files as files
from graphmem import OutputError, UserInputError, analyze
from graphmem.report.files import check_destination, check_output_path, staged_files, write_files
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"


def test_destination_checks(tmp_path: Path) -> None:
    assert check_destination(str(tmp_path / "a.json")) == str(tmp_path / "a.json")
    with pytest.raises(UserInputError, match="is a directory"):
        check_destination(str(tmp_path))
    with pytest.raises(UserInputError, match="does not exist"):
        check_destination(str(tmp_path / "missing" / "a.json"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UserInputError, match="is not a folder"):
        check_destination(str(tmp_path / "file" / "a.json"))
    with pytest.raises(UserInputError, match="unknown file type .json"):
        check_output_path("dot", str(tmp_path / "a.json"))
    assert os.listdir(tmp_path) == ["file"]  # the probe leaves nothing behind


def test_unwritable_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK) and os.geteuid() == 0:  # root writes anywhere: use a folder nobody can
            folder = Path("/sys")
        with pytest.raises(UserInputError, match="no file can be created in folder"):
            check_destination(str(folder / "a.json"))
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_staged_files_commit_together_or_not_at_all(tmp_path: Path) -> None:
    with staged_files() as staged:
        Path(staged.path_for(str(tmp_path / "a.txt"))).write_text("a")
        Path(staged.path_for(str(tmp_path / "b.svg"))).write_text("b")
        names = os.listdir(tmp_path)  # under temporary names in the same folder until the commit
        assert len(names) == 2 and all(n.startswith(".") and ".partial" in n for n in names)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.svg"]
    with pytest.raises(KeyboardInterrupt), staged_files() as staged:
        Path(staged.path_for(str(tmp_path / "c.txt"))).write_text("c")
        raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.svg"]


def test_a_failing_picture_leaves_no_picture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = analyze(MLP, ["2x1000"], mode="inference")

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_dot", full_disk)
    with pytest.raises(OutputError, match="No space left on device"):
        write_files(report, timeline=str(tmp_path / "t.svg"), snapshot=str(tmp_path / "s.pickle"),
                    dot=str(tmp_path / "g.dot"))
    assert os.listdir(tmp_path) == []
