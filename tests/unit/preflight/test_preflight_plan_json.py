"""plan's JSON: each row's changes written as the options take them (``parallel`` parses as
``--parallel``; FSDP2 keeping parameters after forward as ``reshard_after_forward: false``), and
the ranking's keys named for what they are (``effort_rank``, ``departure_rank``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from graphmem.cli import main
from graphmem.job.parallel import parse_parallel
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"


def test_plan_json_writes_parallel_as_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHMEM_PROCESSES", "1")
    result = CliRunner().invoke(main, ["plan", MLP, "--input", "32x1000", "--budget", "1MiB", "--world-size", "2",
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    sharded = [r for r in rows if "parallel" in r["changes"]]
    assert {r["changes"]["parallel"] for r in sharded} == {"zero1=2", "fsdp=2"}
    for row in sharded:
        parse_parallel(row["changes"]["parallel"])  # --parallel accepts it
    kept = [r for r in sharded if "parameters kept after forward" in r["name"]]
    assert kept and all(r["changes"]["reshard_after_forward"] is False for r in kept)
    assert all("reshard_after_forward" not in r["changes"] for r in sharded if r not in kept)
    for row in rows:
        assert "effort" not in row and "departure" not in row
        assert row["effort_rank"] in (0, 1, 2) and 0 <= row["departure_rank"] <= 7
    assert all(r["effort_rank"] == 2 for r in sharded)  # more GPUs: more hardware
