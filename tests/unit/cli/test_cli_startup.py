"""The command line starts in a blink: the group's --help and --version import no torch, and
the group's list of commands is the commands' own."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from tests.conftest import ROOT


def test_group_help_lists_each_commands_own_short_help() -> None:
    import graphmem.cli.commands  # noqa: F401  (registers every command)
    from graphmem.cli.group import FIRST_PARAGRAPH, main

    real = {name: " ".join((command.help or "").split("\n\n")[0].split()) for name, command in main.commands.items()}
    assert real == FIRST_PARAGRAPH
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0 and all(name in shown.output for name in real)


def test_help_and_version_import_no_torch() -> None:
    code = ("import sys\nfrom graphmem.cli.group import main\n"
            "for args in (['--help'], ['--version']):\n"
            "    try:\n        main.main(args, prog_name='graphmem', standalone_mode=False)\n"
            "    except SystemExit:\n        pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no torch") and "Commands:" in done.stdout
