"""What recomputing an op costs (graphmem/preflight/policy/costs.py): FLOPs on the CPU target, and
on a GPU with known peak rates a roofline time, checked on ops built by hand against the
arithmetic done here."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from graphmem.cuda.gpus import ROOFLINES
from graphmem.preflight.policy.costs import FLOPS, cost_model
from graphmem.records import OpRecord, Phase, StorageRecord

_H100 = ROOFLINES["h100-80gb"]


def _storage(sid: int, nbytes: int, created: int, dtype: str) -> StorageRecord:
    return StorageRecord(sid, nbytes, created, None, frozenset(), "", (nbytes,), dtype)


def _mode() -> Any:
    """A bf16 matmul (2 MiB and 4 MiB in, 8 MiB out), a view of its output, and an fp32 GELU of
    a 16 MiB tensor, the last two recomputed."""
    ops = (OpRecord(0, "aten.mm.default", Phase.FORWARD, 0, "fc", (0, 1), (2,), 0, flops=2 * 1024 * 2048 * 2048),
           OpRecord(1, "aten.view.default", Phase.BACKWARD, 0, "fc", (2,), (2,), 0, recompute=True),
           OpRecord(2, "aten.gelu.default", Phase.BACKWARD, 0, "act", (3,), (4,), 0, recompute=True))
    storages = (_storage(0, 2 << 20, -1, "torch.bfloat16"), _storage(1, 4 << 20, -1, "torch.bfloat16"),
                _storage(2, 8 << 20, 0, "torch.bfloat16"), _storage(3, 16 << 20, -1, "torch.float32"),
                _storage(4, 16 << 20, 2, "torch.float32"))
    return SimpleNamespace(trace=SimpleNamespace(ops=ops, storages=storages))


def test_flops_on_the_cpu_target() -> None:
    assert cost_model("cpu", None) is FLOPS and cost_model("cuda", "t4") is FLOPS  # no rates held for a T4
    assert FLOPS.op_costs(_mode()) == [2 * 1024 * 2048 * 2048, 0, 0]
    assert FLOPS.recompute(_mode()) == 0


def test_a_roofline_time_on_an_h100() -> None:
    model = cost_model("cuda", "h100-80gb")
    assert model.roofline == _H100 and model.unit == "ns"
    matmul = max(2 * 1024 * 2048 * 2048 / (989.4e12), (14 << 20) / 3350e9)  # compute-bound: 8.7 us
    gelu = (32 << 20) / 3350e9  # no FLOPs, 16 MiB read and 16 MiB written
    assert model.op_costs(_mode()) == [math.ceil(matmul * 1e9), 0, math.ceil(gelu * 1e9)]
    assert model.recompute(_mode()) == math.ceil(gelu * 1e9)
