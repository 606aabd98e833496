"""Which part of the command line is graphmem's (graphmem.cli.arguments.own_arguments): all of
it, but for ``graphmem run``, whose options end at the program as python's do.  The supervisor
reads --format and --timeout from that part alone, and it imports no click, so it keeps its own
table of run's flags: the first test keeps that table equal to the click command's."""

from __future__ import annotations

import click
import pytest

from graphmem.cli.arguments import RUN_FLAGS, own_arguments


def test_the_supervisors_table_of_run_flags_is_the_click_commands() -> None:
    from graphmem.cli.commands import main

    run = main.commands["run"]
    group = click.Context(main, info_name="graphmem", **main.context_settings)  # -h / --help, as the group gives
    context = click.Context(run, info_name="run", parent=group)
    flags = {name for param in run.get_params(context) if isinstance(param, click.Option)
             and (param.is_flag or param.count) for name in (*param.opts, *param.secondary_opts)}
    assert flags == RUN_FLAGS
    assert {"-h", "--help"} <= flags  # the help option was counted (it comes from the context)


@pytest.mark.parametrize("argv, own", [
    # the script ends graphmem's options: the program's --timeout, --format, -h are its own
    (["run", "--timeout", "20s", "prog.py", "--timeout", "2", "--format", "json", "-h"], ["run", "--timeout", "20s"]),
    # an option's value is not the script, whatever it looks like
    (["run", "--output", "out.json", "--steps", "3", "prog.py", "--steps", "1"],
     ["run", "--output", "out.json", "--steps", "3"]),
    (["run", "--alloc-conf", "prog.py", "prog.py"], ["run", "--alloc-conf", "prog.py"]),
    # --opt=value, -oFILE: one token each
    (["run", "--format=json", "-oout.json", "prog.py", "--format=table"], ["run", "--format=json", "-oout.json"]),
    # flags take no value
    (["run", "--debug", "--no-progress", "prog.py", "--debug"], ["run", "--debug", "--no-progress"]),
    # -m MODULE ends them too, as python -m does; so does --
    (["run", "--format", "json", "-m", "pkg.train", "--timeout", "0"], ["run", "--format", "json", "-m", "pkg.train"]),
    (["run", "-mpkg.train", "--timeout", "0"], ["run", "-mpkg.train"]),
    (["run", "--steps", "1", "--", "--timeout", "0"], ["run", "--steps", "1"]),
    (["run", "-m"], ["run", "-m"]),
    # every other command: the whole command line
    (["check", "m.py:M", "--timeout", "5s", "--format", "json"], ["check", "m.py:M", "--timeout", "5s", "--format",
                                                                  "json"]),
    ([], []),
])
def test_own_arguments(argv: list[str], own: list[str]) -> None:
    assert own_arguments(argv) == own
