"""The scratch layer (graphmem.trace.program.scratch): a program run in-process sees its own
writes, and the real files are byte for byte as they were after the layer exits.

Each test holds real files of random bytes in a folder (``world``), runs what a training
program does inside ``layered``, checks the program's view inside, and checks every real file,
folder, mode and time against a snapshot taken before (by the fixture, after the test)."""

from __future__ import annotations

import builtins
import csv
import errno
import glob
import io
import json
import logging
import os
import pathlib
import pickle
import posix
import shutil
import stat
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphmem.trace.program.scratch import Change, Scratch, layered


def _snapshot(folder: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``folder``: its bytes (a file), its target (a symlink), its mode and
    modification time, read with the posix module's own functions."""
    seen: dict[str, tuple[object, ...]] = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(top, name)
            found = posix.lstat(path)
            if stat.S_ISLNK(found.st_mode):
                content: object = ("link", posix.readlink(path))
            elif stat.S_ISDIR(found.st_mode):
                content = ("folder", sorted(posix.listdir(path)))
            else:
                with io.FileIO(path) as handle:
                    content = handle.read()
            seen[os.path.relpath(path, folder)] = (content, found.st_mode, found.st_mtime_ns)
    return seen


@dataclass
class World:
    real: Path  # the user's folder, the working folder
    scratch: Scratch
    data: dict[str, bytes]  # the real files' bytes by name
    snapshot: dict[str, tuple[object, ...]]  # every real entry, as checked after the test

    def before(self, name: str) -> bytes:
        return self.data[name]

    def real_symlink(self, target: str, name: str) -> None:
        """A real symlink, made before the layer (and added to the snapshot)."""
        os.symlink(target, self.real / name)
        self.snapshot = _snapshot(self.real)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    real = tmp_path / "real"
    (real / "runs" / "old").mkdir(parents=True)
    data = {
        "ckpt.pt": os.urandom(4096),
        "latest.pt": os.urandom(3000),
        "prev.pt": os.urandom(2000),
        "train.log": b"step 1\nstep 2\n",
        "config.json": json.dumps({"lr": 0.1}).encode(),
        "runs/old/a.bin": os.urandom(100),
        "runs/old/b.bin": os.urandom(200),
        "runs/notes.txt": b"notes",
    }
    for name, content in data.items():
        (real / name).write_bytes(content)
    os.utime(real / "ckpt.pt", (1_000_000, 1_000_000))
    monkeypatch.chdir(real)
    world = World(real, Scratch(str(tmp_path / "layer")), data, _snapshot(real))
    yield world
    assert _snapshot(real) == world.snapshot, "a real file changed"


def _read(path: str | Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


# -- checkpoints --------------------------------------------------------------------------


def test_a_checkpoint_written_through_a_file_object_leaves_the_real_one_whole(world: World) -> None:
    state = {"weights": list(range(100))}
    with layered(world.scratch):
        with open("ckpt.pt", "wb") as handle:
            pickle.dump(state, handle)  # torch.save(sd, f) writes through the file object too
            assert handle.name == "ckpt.pt"
        with open("ckpt.pt", "rb") as handle:
            assert pickle.load(handle) == state
        with open("ckpt.pt", "wb") as handle:  # torch.save's zip writer: seeks and tells
            with zipfile.ZipFile(handle, "w") as archive:
                archive.writestr("archive/data.pkl", pickle.dumps(state))
        with zipfile.ZipFile("ckpt.pt") as archive:
            assert pickle.loads(archive.read("archive/data.pkl")) == state
        assert os.path.getsize("ckpt.pt") == len(_read("ckpt.pt")) != 4096
    assert _read(world.real / "ckpt.pt") == world.before("ckpt.pt")


def test_an_appended_log_reads_old_and_new_lines_inside(world: World) -> None:
    with layered(world.scratch):
        with open("train.log", "a") as handle:
            handle.write("step 3\n")
        with open("train.log") as handle:
            assert handle.read() == "step 1\nstep 2\nstep 3\n"
        with open("train.log", "r+b") as handle:  # r+ copies the real bytes in too
            handle.seek(0)
            handle.write(b"STEP")
        assert _read("train.log") == b"STEP 1\nstep 2\nstep 3\n"


def test_rotation_at_start_keeps_both_real_checkpoints(world: World) -> None:
    with layered(world.scratch):
        os.rename("latest.pt", "prev.pt")
        with open("latest.pt", "wb") as handle:
            handle.write(b"new checkpoint")
        assert _read("prev.pt") == world.before("latest.pt")
        assert _read("latest.pt") == b"new checkpoint"
        assert sorted(name for name in os.listdir(".") if name.endswith(".pt")) == ["ckpt.pt", "latest.pt", "prev.pt"]
    assert _read(world.real / "latest.pt") == world.before("latest.pt")
    assert _read(world.real / "prev.pt") == world.before("prev.pt")


def test_an_atomic_save_replaces_the_checkpoint_for_the_program_only(world: World) -> None:
    with layered(world.scratch):
        with open("ckpt.pt.tmp", "wb") as handle:
            handle.write(b"atomic")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace("ckpt.pt.tmp", "ckpt.pt")
        assert _read("ckpt.pt") == b"atomic"
        assert not os.path.exists("ckpt.pt.tmp")
        fd, name = tempfile.mkstemp(dir=".", suffix=".tmp")  # another library's atomic save
        os.write(fd, b"mkstemp")
        os.close(fd)
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
        os.replace(name, "latest.pt")
        assert _read("latest.pt") == b"mkstemp"
    assert not list(world.real.glob("*.tmp"))


def test_a_deleted_real_file_is_gone_inside_and_there_after(world: World) -> None:
    with layered(world.scratch):
        os.remove("ckpt.pt")
        Path("prev.pt").unlink()
        assert not os.path.exists("ckpt.pt") and not Path("prev.pt").exists()
        with pytest.raises(FileNotFoundError):
            open("ckpt.pt", "rb")
        with pytest.raises(FileNotFoundError):
            os.remove("ckpt.pt")
        Path("prev.pt").unlink(missing_ok=True)
        assert "ckpt.pt" not in os.listdir(".")


def test_a_real_folder_removed_and_made_again_is_empty_but_for_the_new_file(world: World) -> None:
    with layered(world.scratch):
        shutil.rmtree("runs")
        assert not os.path.exists("runs") and not os.path.exists("runs/old/a.bin")
        os.makedirs("runs/old")
        with open("runs/old/c.bin", "wb") as handle:
            handle.write(b"c")
        assert os.listdir("runs") == ["old"]
        assert os.listdir("runs/old") == ["c.bin"]
        assert not os.path.exists("runs/old/a.bin")
        with pytest.raises(FileNotFoundError):
            shutil.rmtree("missing")
        shutil.rmtree("missing", ignore_errors=True)
        errors: list[object] = []
        shutil.rmtree("config.json", onerror=lambda *args: errors.append(args[0]))
        assert len(errors) == 1 and os.path.exists("config.json")


def test_a_renamed_real_folder_reads_its_real_files_under_the_new_name(world: World) -> None:
    with layered(world.scratch):
        os.rename("runs", "runs_2")
        assert not os.path.exists("runs")
        assert sorted(os.listdir("runs_2")) == ["notes.txt", "old"]
        assert _read("runs_2/old/a.bin") == world.before("runs/old/a.bin")
        with open("runs_2/old/a.bin", "ab") as handle:
            handle.write(b"+")
        assert _read("runs_2/old/a.bin") == world.before("runs/old/a.bin") + b"+"
        os.remove("runs_2/old/b.bin")
        shutil.move("runs_2", "runs_3")
        assert sorted(os.listdir("runs_3/old")) == ["a.bin"]


# -- libraries ----------------------------------------------------------------------------


def test_numpy_saves_and_loads_round_trip_inside(world: World) -> None:
    np = pytest.importorskip("numpy")
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    with layered(world.scratch):
        np.save("ckpt.pt", values)  # numpy adds .npy
        assert np.array_equal(np.load("ckpt.pt.npy"), values)
        np.savez("arrays.npz", a=values, b=values * 2)
        with np.load("arrays.npz") as loaded:
            assert np.array_equal(loaded["b"], values * 2)
        np.savetxt("values.txt", values)
        assert np.array_equal(np.loadtxt("values.txt"), values)
        mapped = np.memmap("map.bin", dtype=np.float32, mode="w+", shape=(4,))
        mapped[:] = 7
        mapped.flush()
        del mapped
        assert np.fromfile("map.bin", dtype=np.float32).tolist() == [7.0] * 4
    assert sorted(os.listdir(world.real)) == sorted(
        ["ckpt.pt", "latest.pt", "prev.pt", "train.log", "config.json", "runs"]
    )


def test_json_csv_logging_and_zip_write_to_the_layer(world: World) -> None:
    with layered(world.scratch):
        with open("config.json", "w") as handle:
            json.dump({"lr": 0.5}, handle)
        with open("config.json") as handle:
            assert json.load(handle) == {"lr": 0.5}
        with open("metrics.csv", "w", newline="") as handle:
            csv.writer(handle).writerows([["step", "loss"], [1, 0.5]])
        with open("metrics.csv", newline="") as handle:
            assert list(csv.reader(handle)) == [["step", "loss"], ["1", "0.5"]]
        handler = logging.FileHandler("train.log")
        logger = logging.getLogger("test_scratch")
        logger.addHandler(handler)
        logger.warning("step 3")
        handler.close()
        logger.removeHandler(handler)
        assert _read("train.log") == b"step 1\nstep 2\nstep 3\n"
        with zipfile.ZipFile("bundle.zip", "w") as archive:
            archive.write("config.json")
        with zipfile.ZipFile("bundle.zip", "a") as archive:  # 'a' opens r+b: copied in first
            archive.writestr("more.txt", "more")
        assert zipfile.ZipFile("bundle.zip").namelist() == ["config.json", "more.txt"]


def test_pathlib_goes_through_the_layer(world: World) -> None:
    with layered(world.scratch):
        out = Path("out")
        out.mkdir()
        with pytest.raises(FileExistsError):
            out.mkdir()
        out.mkdir(exist_ok=True)
        (out / "a.txt").write_text("a")
        (out / "b.txt").touch()
        Path("ckpt.pt").touch()  # a real file's times: changed in the layer only
        assert (out / "a.txt").read_text() == "a" and (out / "b.txt").exists()
        assert sorted(path.name for path in out.iterdir()) == ["a.txt", "b.txt"]
        assert sorted(str(path) for path in Path(".").glob("out/*.txt")) == ["out/a.txt", "out/b.txt"]
        assert sorted(str(path) for path in Path(".").rglob("*.bin")) == ["runs/old/a.bin", "runs/old/b.bin"]
        (out / "a.txt").rename(out / "c.txt")
        (out / "b.txt").replace("latest.pt")
        assert Path("latest.pt").read_bytes() == b""
        assert (out / "c.txt").is_file() and not (out / "a.txt").exists() and out.is_dir()
        assert Path("out/c.txt").resolve() == world.real / "out" / "c.txt"
        assert Path("config.json").stat().st_size == len(world.before("config.json"))
    assert not (world.real / "out").exists()


def test_walk_and_glob_merge_real_and_layer_entries(world: World) -> None:
    with layered(world.scratch):
        os.makedirs("runs/new/deep")
        with open("runs/new/deep/x.bin", "wb") as handle:
            handle.write(b"x")
        os.remove("runs/old/b.bin")
        walked = {os.path.relpath(top): (sorted(dirs), sorted(files)) for top, dirs, files in os.walk("runs")}
        assert walked == {
            "runs": (["new", "old"], ["notes.txt"]),
            "runs/new": (["deep"], []),
            "runs/new/deep": ([], ["x.bin"]),
            "runs/old": ([], ["a.bin"]),
        }
        assert sorted(glob.glob("runs/**/*.bin", recursive=True)) == ["runs/new/deep/x.bin", "runs/old/a.bin"]
        with os.scandir("runs") as entries:
            found = {entry.name: (entry.is_dir(), entry.is_file(), entry.is_symlink()) for entry in entries}
        assert found == {"old": (True, False, False), "notes.txt": (False, True, False), "new": (True, False, False)}
        entry = next(entry for entry in os.scandir("runs/new/deep"))
        assert entry.path == "runs/new/deep/x.bin" and os.fspath(entry) == entry.path
        assert entry.stat().st_size == 1 and entry.inode() == os.lstat(entry.path).st_ino
        assert os.listdir(b"runs/new") == [b"deep"]


# -- errors as the OS gives them ----------------------------------------------------------


def test_errors_are_the_oss(world: World) -> None:
    with layered(world.scratch):
        with pytest.raises(FileExistsError):
            open("ckpt.pt", "x")
        with pytest.raises(FileNotFoundError) as missing:
            open("no/such/folder/ckpt.pt", "wb")
        assert missing.value.filename == "no/such/folder/ckpt.pt"
        with pytest.raises(NotADirectoryError):
            open("ckpt.pt/inner", "wb")
        with pytest.raises(IsADirectoryError):
            open("runs", "wb")
        with pytest.raises(FileExistsError):
            os.mkdir("runs")
        with pytest.raises(OSError) as full:
            os.rmdir("runs")
        assert full.value.errno == errno.ENOTEMPTY
        with pytest.raises(NotADirectoryError):
            os.listdir("ckpt.pt")
        with pytest.raises(IsADirectoryError):
            os.remove("runs")
        with pytest.raises(FileNotFoundError):
            os.rename("missing.pt", "other.pt")
        with pytest.raises(FileNotFoundError):
            open("fresh.txt", "r+")
        with open("fresh.txt", "x") as handle:
            handle.write("x")
        with pytest.raises(FileExistsError):
            os.open("fresh.txt", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def test_the_temporary_folder_is_the_layers(world: World) -> None:
    saved = (tempfile.tempdir, os.environ.get("TMPDIR"))
    with layered(world.scratch):
        assert tempfile.gettempdir() == world.scratch.tmp == os.environ["TMPDIR"]
        with tempfile.NamedTemporaryFile(delete=False) as handle:
            handle.write(b"temporary")
        assert os.path.dirname(handle.name) == world.scratch.tmp
        assert posix.stat(handle.name).st_size == 9  # written for real, in the layer's folder
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "x").write_text("x")
        shutil.move(handle.name, "moved.bin")  # from the temporary folder into the user's
        assert _read("moved.bin") == b"temporary"
        with open(os.devnull, "w") as sink:
            sink.write("nothing")
    assert (tempfile.tempdir, os.environ.get("TMPDIR")) == saved


def test_a_write_through_a_symlinked_folder_is_one_file_by_either_name(world: World, tmp_path: Path) -> None:
    os.symlink(world.real / "runs", tmp_path / "link")
    with layered(world.scratch):
        with open(tmp_path / "link" / "notes.txt", "ab") as handle:
            handle.write(b"+more")
        assert _read("runs/notes.txt") == b"notes+more"
        with open("runs/made.txt", "w") as handle:
            handle.write("made")
        assert _read(tmp_path / "link" / "made.txt") == b"made"
        assert sorted(os.listdir(tmp_path / "link")) == ["made.txt", "notes.txt", "old"]
        os.symlink("runs/old", "old_link")  # the program's own symlink
        assert sorted(os.listdir("old_link")) == ["a.bin", "b.bin"]
        assert os.readlink("old_link") == "runs/old" and os.path.islink("old_link")
        assert os.path.realpath("old_link/a.bin") == str(world.real / "runs/old/a.bin")
    assert not (world.real / "old_link").exists()


def test_dir_fd_resolves_to_its_folder(world: World) -> None:
    with layered(world.scratch):
        os.makedirs("out")
        folder = os.open("runs", os.O_RDONLY | os.O_DIRECTORY)
        mine = os.open("out", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.unlink("notes.txt", dir_fd=folder)
            fd = os.open("made.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mine)
            os.write(fd, b"made")
            os.close(fd)
            assert os.stat("made.bin", dir_fd=mine).st_size == 4
            assert sorted(os.listdir(mine)) == ["made.bin"]
            os.mkdir("sub", dir_fd=folder)
        finally:
            os.close(folder)
            os.close(mine)
        assert sorted(os.listdir("runs")) == ["old", "sub"]
        assert _read("out/made.bin") == b"made"


def test_shutil_copies_and_chmod_stay_in_the_layer(world: World) -> None:
    with layered(world.scratch):
        shutil.copy2("ckpt.pt", "copy.pt")
        assert _read("copy.pt") == world.before("ckpt.pt")
        assert os.stat("copy.pt").st_mtime_ns == os.stat("ckpt.pt").st_mtime_ns
        shutil.copytree("runs", "runs_copy")
        assert sorted(os.listdir("runs_copy/old")) == ["a.bin", "b.bin"]
        shutil.copyfile("config.json", "ckpt.pt")
        assert _read("ckpt.pt") == world.before("config.json")
        os.chmod("prev.pt", 0o600)
        assert stat.S_IMODE(os.stat("prev.pt").st_mode) == 0o600
        os.truncate("latest.pt", 10)
        assert _read("latest.pt") == world.before("latest.pt")[:10]
        os.link("prev.pt", "hard.pt")
        assert _read("hard.pt") == world.before("prev.pt")


def test_a_folder_only_the_layer_has_can_be_the_working_folder(world: World) -> None:
    with layered(world.scratch):
        os.makedirs("out/logs")
        os.chdir("out")
        assert os.getcwd() == str(world.real / "out") == str(Path.cwd())
        with open("logs/x.txt", "w") as handle:
            handle.write("x")
        assert os.listdir("logs") == ["x.txt"] and _read("../out/logs/x.txt") == b"x"
        assert os.path.abspath("logs") == str(world.real / "out" / "logs")
        os.chdir("..")
        assert os.getcwd() == str(world.real)
    assert not (world.real / "out").exists()


def test_folder_renames_are_refused_as_the_os_refuses_them(world: World) -> None:
    with layered(world.scratch):
        os.mkdir("empty")
        with pytest.raises(OSError) as full:
            os.rename("empty", "runs")
        assert full.value.errno == errno.ENOTEMPTY
        with pytest.raises(OSError) as inside:
            os.rename("runs", "runs/old/x")
        assert inside.value.errno == errno.EINVAL
        with pytest.raises(NotADirectoryError):
            os.rename("empty", "ckpt.pt")
        with pytest.raises(IsADirectoryError):
            os.rename("ckpt.pt", "empty")
        os.rename("runs/old", "empty")  # onto an empty folder: replaces it
        assert sorted(os.listdir("empty")) == ["a.bin", "b.bin"] and os.listdir("runs") == ["notes.txt"]
        assert not os.access("runs/old", os.F_OK) and os.access("empty/a.bin", os.R_OK | os.W_OK)


def test_bytes_paths_dotdot_and_descriptors(world: World) -> None:
    with layered(world.scratch):
        with open(b"runs/new.bin", "wb") as handle:
            handle.write(b"new")
            assert handle.name == b"runs/new.bin"
        assert sorted(os.listdir(b"runs")) == [b"new.bin", b"notes.txt", b"old"]
        assert _read("runs/old/../new.bin") == b"new"
        assert [entry.path for entry in os.scandir(b"runs") if entry.name == b"new.bin"] == [b"runs/new.bin"]
        assert sorted(glob.glob("*.bin", root_dir="runs")) == ["new.bin"]  # 3.11: through os.open and scandir(fd)
        walked = [(top, sorted(dirs), sorted(files)) for top, dirs, files, _ in os.fwalk("runs")]
        assert walked == [("runs", ["old"], ["new.bin", "notes.txt"]), ("runs/old", [], ["a.bin", "b.bin"])]
        fd = os.open("runs/new.bin", os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"+")
        os.truncate(fd, 2)  # an open descriptor passes through: it is the layer's file
        os.close(fd)
        assert _read("runs/new.bin") == b"ne"


def test_symlinks_read_what_the_program_sees_at_their_targets(world: World) -> None:
    world.real_symlink("runs/notes.txt", "notes_link")
    world.real_symlink("nowhere.txt", "dangling")
    with layered(world.scratch):
        with open("runs/notes.txt", "ab") as handle:
            handle.write(b"+")
        assert _read("notes_link") == b"notes+"
        os.remove("runs/notes.txt")
        assert not os.path.exists("notes_link") and os.path.lexists("notes_link")
        with open("dangling", "w") as handle:  # a write through a dangling link makes its target
            handle.write("made")
        assert _read("nowhere.txt") == b"made" and os.readlink("dangling") == "nowhere.txt"
        os.rename("notes_link", "moved_link")  # a real symlink renamed: still a symlink
        assert os.path.islink("moved_link") and os.readlink("moved_link") == "runs/notes.txt"
    assert not (world.real / "nowhere.txt").exists()


def test_metadata_changes_to_real_files_and_folders_stay_in_the_layer(world: World) -> None:
    with layered(world.scratch):
        os.chmod("runs", 0o700)
        os.utime("runs/old", ns=(5, 5))
        os.utime("ckpt.pt", ns=(7, 7))
        assert stat.S_IMODE(os.stat("runs").st_mode) == 0o700
        assert os.stat("runs/old").st_mtime_ns == 5 and os.stat("ckpt.pt").st_mtime_ns == 7
        assert sorted(os.listdir("runs")) == ["notes.txt", "old"]  # its entries still show through
        assert _read("ckpt.pt") == world.before("ckpt.pt")


def test_files_move_between_the_temporary_folder_and_the_layer(world: World) -> None:
    with layered(world.scratch):
        inside_tmp = os.path.join(tempfile.gettempdir(), "moved.log")
        os.rename("train.log", inside_tmp)  # out of the layer: a real file in the layer's folder
        assert posix.stat(inside_tmp).st_size == len(world.before("train.log"))
        assert not os.path.exists("train.log")
        os.replace(inside_tmp, "train.log")  # and back in
        assert _read("train.log") == world.before("train.log") and not os.path.exists(inside_tmp)


# -- the layer itself ---------------------------------------------------------------------


def test_changes_lists_each_action_with_its_size(world: World) -> None:
    with layered(world.scratch):
        with open("ckpt.pt", "wb") as handle:
            handle.write(b"12345")
        with open("train.log", "a") as handle:
            handle.write("step 3\n")
        with open("new.txt", "w") as handle:
            handle.write("abc")
        with open("new.txt", "a") as handle:  # part of its making: not listed again
            handle.write("d")
        os.rename("latest.pt", "prev.pt")
        os.remove("config.json")
        os.mkdir("out")
        shutil.rmtree("runs")
    real = str(world.real)
    assert world.scratch.changes() == (
        Change(f"{real}/ckpt.pt", "overwritten", 5),
        Change(f"{real}/train.log", "appended", 21),
        Change(f"{real}/new.txt", "created", 4),
        Change(f"{real}/latest.pt", "renamed", 3000, f"{real}/prev.pt"),
        Change(f"{real}/prev.pt", "overwritten", 3000),
        Change(f"{real}/config.json", "deleted", 0),
        Change(f"{real}/out", "directory created", 0),
        Change(f"{real}/runs", "directory deleted", 0),
    )


def test_threads_write_through_the_layer(world: World) -> None:
    def work(index: int) -> None:
        os.makedirs(f"out/{index % 3}", exist_ok=True)
        for step in range(20):
            with open(f"out/{index % 3}/t{index}.log", "a") as handle:
                handle.write(f"{step}\n")
            os.path.exists("ckpt.pt")

    with layered(world.scratch):
        threads = [threading.Thread(target=work, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index in range(8):
            assert _read(f"out/{index % 3}/t{index}.log") == "".join(f"{step}\n" for step in range(20)).encode()
        assert sorted(os.listdir("out")) == ["0", "1", "2"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_forked_try_detached_leaves_the_parents_view_alone(world: World, tmp_path: Path) -> None:
    with layered(world.scratch):
        with open("ckpt.pt", "wb") as handle:
            handle.write(b"parent")
        reading, writing = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own layer, then its writes
            code = 1
            try:
                world.scratch.detach(str(tmp_path / "child"))
                assert tempfile.gettempdir() == str(tmp_path / "child" / "tmp")
                with open("ckpt.pt", "ab") as handle:
                    handle.write(b"+child")
                with open("child.txt", "w") as handle:
                    handle.write("child")
                os.remove("prev.pt")
                assert _read("ckpt.pt") == b"parent+child" and not os.path.exists("prev.pt")
                code = 0
            finally:
                os.write(writing, bytes([code]))
                os._exit(code)
        os.close(writing)
        _, status = os.waitpid(pid, 0)
        assert os.read(reading, 1) == b"\0" and os.waitstatus_to_exitcode(status) == 0
        os.close(reading)
        assert _read("ckpt.pt") == b"parent"
        assert not os.path.exists("child.txt") and _read("prev.pt") == world.before("prev.pt")
        assert tempfile.gettempdir() == world.scratch.tmp


def test_every_replaced_name_is_the_original_after(world: World) -> None:
    modules = (os, os.path, io, builtins, shutil, pathlib, tempfile, posix, glob, sys, sys.modules["_io"])
    before = [dict(vars(module)) for module in modules]
    environ = dict(os.environ)
    with pytest.raises(RuntimeError), layered(world.scratch):
        assert os.stat is not before[0]["stat"] and builtins.open is not before[3]["open"]
        assert sys.dont_write_bytecode  # importlib writes no __pycache__ beside the program
        assert posix.stat is before[7]["stat"]  # importlib's reads stay the OS's
        raise RuntimeError("the program failed")
    for module, saved in zip(modules, before, strict=True):
        changed = [name for name, value in vars(module).items() if saved.get(name, value) is not value]
        assert not changed, f"{module.__name__}: {changed}"
    assert dict(os.environ) == environ and io.open is builtins.open


def test_a_path_nothing_changed_reads_the_real_file_and_copies_nothing(world: World) -> None:
    with layered(world.scratch):
        with open("made.txt", "w") as handle:  # the layer has a change: lookups are not skipped
            handle.write("x")
        assert all(os.path.exists("config.json") for _ in range(2000))  # remembered after the first
        assert os.stat("config.json").st_ino == posix.stat("config.json").st_ino
        assert _read("runs/old/a.bin") == world.before("runs/old/a.bin")
    assert [change.action for change in world.scratch.changes()] == ["created"]
    assert os.listdir(os.path.join(world.scratch.root, "files")) == ["0"]  # made.txt's bytes only
