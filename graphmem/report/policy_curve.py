"""Stage 4 for ``graphmem plan --policy --policy-curve FILE``: the memory/recompute front as a
picture (matplotlib, the ``viz`` extra).  PolicyPlan -> SVG or PNG.

Each analysed point of the front is drawn at its extra compute and its analysed peak, labelled
with the blocks it checkpoints; the budget is a horizontal line, the chosen point is marked.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from graphmem.job.grammar import format_blocks
from graphmem.report.formats import require_matplotlib
from graphmem.units import UNITS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from graphmem.preflight.policy.search import PolicyPlan

__all__ = ["policy_curve_figure", "write_policy_curve"]


def _unit(peak: int, units: str) -> str:
    return units if units != "auto" else next((u for u in reversed(UNITS) if peak >= UNITS[u]), "B")


def policy_curve_figure(policy: PolicyPlan, title: str, units: str = "auto") -> Figure:
    """The front as a matplotlib Figure (no pyplot state is touched)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    unit = _unit(max(p.peak_bytes for p in policy.front), units)
    scale = UNITS[unit]
    xs = [100 * p.extra_compute for p in policy.front]
    ys = [p.peak_bytes / scale for p in policy.front]
    ax.step(xs, ys, where="post", color="#4c72b0", linewidth=1, alpha=0.5)
    ax.plot(xs, ys, "o", color="#4c72b0", label="analysed choices on the front")
    for point, x, y in zip(policy.front, xs, ys, strict=True):
        ax.annotate(format_blocks(point.blocks) or "none", (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize="x-small")
    ax.axhline(policy.budget.cap_bytes / scale, color="#b00020", linestyle="--", linewidth=1,
               label=f"budget ({policy.budget.source})")
    if policy.chosen is not None:
        ax.plot([100 * policy.chosen.extra_compute], [policy.chosen.peak_bytes / scale], "*", markersize=14,
                color="#dd8452", label="chosen: the least recompute that fits")
    ax.set_xlabel("extra compute (% of the step's FLOPs)")
    ax.set_ylabel(f"peak ({unit})")
    ax.set_title(title, loc="left")
    ax.legend(fontsize="small", frameon=False)
    return fig


def write_policy_curve(policy: PolicyPlan, path: str | Path, target: str, units: str = "auto") -> None:
    """Write the front to ``path``; its suffix (.svg, .png) picks the format."""
    fmt = Path(path).suffix.lower().lstrip(".")
    fig = policy_curve_figure(policy, f"{target}: checkpointing {policy.block_class} blocks, memory against "
                                      "recompute", units)
    buffer = io.BytesIO()
    from matplotlib import rc_context

    with rc_context({"svg.fonttype": "none"}):
        metadata = {"Software": "graphmem"} if fmt == "png" else {"Date": None, "Creator": "graphmem"}
        fig.savefig(buffer, format=fmt, dpi=110, metadata=metadata)
    Path(path).write_bytes(buffer.getvalue())
