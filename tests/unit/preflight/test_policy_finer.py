"""The ops whose outputs a checkpointed block could keep (graphmem/preflight/policy/finer.py), on
examples/gpt.py's GPT with block 0 checkpointed: each Linear's matmul, with the FLOPs its recompute
costs and the bytes of its output, against the counts by hand (2 x tokens x in x out FLOPs per
iteration, tokens x out x 4 bytes)."""

from __future__ import annotations

from graphmem.job import make_job
from graphmem.preflight.policy.finer import keepable
from graphmem.preflight.search import predict
from tests.conftest import ROOT

TOKENS, DIM = 2 * 16, 32


def test_a_checkpointed_blocks_matmuls_by_hand() -> None:
    job = make_job(str(ROOT / "examples" / "gpt.py") + ":GPT", "2x16:int64", mode="train", optimizer="sgd",
                   loss="sum", kwargs={"layers": 2, "dim": DIM, "vocab": 64}, checkpoint="Block",
                   checkpoint_blocks="0")
    mode = predict(job, checkpoint_comparison=False).report.train
    assert mode is not None
    items = {item.name: item for item in keepable(mode, ("blocks.0", "blocks.1"), (1, 0))}
    # the recompute stops at the last tensor backward needs: the out projection's matmul is not re-run
    shapes = {"qkv:matmuls": (DIM, 3 * DIM), "proj:matmuls": (DIM, DIM), "fc:matmuls": (DIM, 4 * DIM)}
    assert set(items) == set(shapes)
    for name, (fan_in, fan_out) in shapes.items():
        assert items[name].block == 0
        assert items[name].flops == 2 * (2 * TOKENS * fan_in * fan_out)  # both recorded iterations
        assert items[name].nbytes == TOKENS * fan_out * 4
