"""graphmem.report.files: output paths checked before the analysis; files whole or absent."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

import graphmem.report.files as files
from graphmem import OutputError, UserInputError, analyze
from graphmem.report.files import check_destination, check_output_path, staged_files, write_files
from tests.conftest import ROOT
from tests.optional import needs

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


# --- Graphviz: a rendered graph needs its `dot` program, looked for before anything is drawn ----

def _path_without_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_dot: bool = False) -> Path:
    """PATH set to one empty folder of ``tmp_path`` (a fake Graphviz ``dot`` in it: ``with_dot``)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    if with_dot:
        (folder / "dot").write_text("#!/bin/sh\nexit 0\n")
        (folder / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    return folder


@needs("pydot")
@pytest.mark.parametrize("suffix", ["svg", "png", "pdf"])
def test_a_rendered_graph_without_graphviz_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      suffix: str) -> None:
    _path_without_graphviz(tmp_path, monkeypatch)
    with pytest.raises(UserInputError) as refused:
        check_output_path("dot", str(tmp_path / f"g.{suffix}"))
    assert str(refused.value) == (f"writing a .{suffix} graph needs Graphviz's `dot` program, which is not on PATH; "
                                  "install Graphviz (apt-get install graphviz, brew install graphviz) or write a "
                                  ".dot file")
    assert os.listdir(tmp_path) == ["bin"]


@needs("pydot")
def test_dot_text_needs_no_graphviz_and_a_rendered_graph_finds_it_on_path(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _path_without_graphviz(tmp_path, monkeypatch)
    for name in ("g.dot", "g.gv"):
        assert check_output_path("dot", str(tmp_path / name)) == str(tmp_path / name)
    (tmp_path / "bin").rmdir()
    _path_without_graphviz(tmp_path, monkeypatch, with_dot=True)
    assert check_output_path("dot", str(tmp_path / "g.png")) == str(tmp_path / "g.png")


@needs("pydot", "matplotlib")
def test_write_files_refuses_a_rendered_graph_without_graphviz_before_drawing_any(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = analyze(MLP, ["2x1000"], mode="inference")
    _path_without_graphviz(tmp_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserInputError, match="needs Graphviz's `dot` program"):
        write_files(report, timeline=str(out / "t.svg"), snapshot=str(out / "s.pickle"), dot=str(out / "g.png"))
    assert os.listdir(out) == []


# --- what each kind of destination becomes --------------------------------------------------

def _write_one(path: Path | str, text: str) -> None:
    with staged_files() as staged:
        Path(staged.path_for(str(path))).write_text(text)


def test_a_trailing_slash_names_a_folder(tmp_path: Path) -> None:
    for path in (f"{tmp_path}/newdir/", f"{tmp_path}/report.json/"):
        with pytest.raises(UserInputError, match="ends in '/', so it names a folder"):
            check_destination(path)
    with pytest.raises(UserInputError, match="names a folder"):  # not "unknown file type (none)"
        check_output_path("dot", f"{tmp_path}/graphs/")
    assert os.listdir(tmp_path) == []


def test_lookup_faults_are_refused_in_words(tmp_path: Path) -> None:
    (tmp_path / "loop.txt").symlink_to("loop.txt")
    with pytest.raises(UserInputError, match="its symbolic links form a loop"):
        check_destination(str(tmp_path / "loop.txt"))
    with pytest.raises(UserInputError, match="longer than its file system allows"):
        check_destination(str(tmp_path / ("a" * 300 + ".txt")))


def test_a_long_name_gets_a_temporary_name_that_fits(tmp_path: Path) -> None:
    name = "a" * 240 + ".txt"  # 244 bytes: valid, but ".NAME.XXXXXXXX.partial.txt" would be 266
    check_destination(str(tmp_path / name))
    _write_one(tmp_path / name, "report")
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_text() == "report"


def test_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "report.txt"
    target.write_text("old")
    target.chmod(0o600)
    _write_one(target, "new")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o600


def test_a_hard_linked_file_is_written_in_place(tmp_path: Path) -> None:
    target, other = tmp_path / "report.txt", tmp_path / "link.txt"
    target.write_text("old content, longer than the new")
    os.link(target, other)
    inode = target.stat().st_ino
    _write_one(target, "new")
    assert other.read_text() == "new" and target.stat().st_ino == inode and target.stat().st_nlink == 2
    assert sorted(os.listdir(tmp_path)) == ["link.txt", "report.txt"]


def test_a_symbolic_link_keeps_pointing_at_its_target(tmp_path: Path) -> None:
    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to("real.txt")
    _write_one(tmp_path / "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "real.txt").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link.txt", "real.txt"]


def test_a_fifo_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="no process reads the FIFO"):  # an error, never a wait without end
        _write_one(fifo, "lost")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _write_one(fifo, "through the pipe")
        assert os.read(reader, 100) == b"through the pipe"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and os.listdir(tmp_path) == ["pipe.txt"]


def test_a_device_is_written_in_place_not_replaced() -> None:
    before = os.stat(os.devnull)
    assert check_destination(os.devnull) == os.devnull
    _write_one(os.devnull, "discarded")
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_socket_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = socket.socket(socket.AF_UNIX)
    monkeypatch.chdir(tmp_path)  # a socket's path is limited to 107 bytes: bind it by a short relative name
    server.bind("s.sock")
    try:
        with pytest.raises(UserInputError, match="it is a socket"):
            check_destination(str(tmp_path / "s.sock"))
    finally:
        server.close()
