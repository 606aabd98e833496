"""graphmem.trace.program.backup: a process kept as it was at a moment, resumed or dropped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graphmem.errors import TraceError
from graphmem.trace.program.backup import Backup, capturing_output

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the backup needs os.fork")


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _go(backup: Backup, log: Path) -> str:
    """What a program does: one line before the fork; after it, the try and the backup differ."""
    with log.open("a") as f:
        f.write("before\n")
    if backup.fork():
        return "cut"
    # the backup: it goes on only when resumed, and ends by sending its result
    backup.send("result", ("whole", _count(log)))
    raise AssertionError("unreachable: send ends the backup")


def test_a_dropped_backup_never_runs(tmp_path: Path) -> None:
    log = tmp_path / "log"
    backup = Backup(on_backup=lambda: log.open("a").write("backup ran\n"))
    assert _go(backup, log) == "cut"
    pid = backup.pid
    backup.drop()
    assert not backup.made and log.read_text() == "before\n"
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)  # reaped: no zombie left


def test_a_resumed_backup_goes_on_from_the_fork_and_sends_its_result(tmp_path: Path) -> None:
    log = tmp_path / "log"
    backup = Backup(on_backup=lambda: log.open("a").write("backup ran\n"))
    assert _go(backup, log) == "cut"
    kind, value = backup.resume()
    # the lines written before the fork once; the backup's own hook ran in it before it went on
    assert (kind, value) == ("result", ("whole", 2)) and log.read_text() == "before\nbackup ran\n"


def test_a_backup_that_dies_is_named(tmp_path: Path) -> None:
    backup = Backup(on_backup=lambda: os._exit(7))
    if not backup.fork():
        raise AssertionError("unreachable")
    with pytest.raises(TraceError, match="exited with status 7"):
        backup.resume()


def test_output_held_is_written_or_dropped(capfd: pytest.CaptureFixture[str]) -> None:
    with capturing_output() as keep:
        os.write(1, b"kept out\n")
        os.write(2, b"kept err\n")
    with capturing_output() as keep:
        os.write(1, b"dropped\n")
        keep(False)
    out, err = capfd.readouterr()
    assert out == "kept out\n" and err == "kept err\n"
