"""Stage 4 for ``graphmem plan``: the what-if table and the explanation, as text or JSON.
``PLAN_RENDERERS`` maps each ``--format`` name to its function."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from graphmem.job.option import spelling
from graphmem.preflight.ranking import RANKING_RULE
from graphmem.report.policy_text import policy_section, policy_to_dict
from graphmem.report.preflight_text import COMPARED_NOTE, Context, context_dict, header
from graphmem.units import format_bytes

if TYPE_CHECKING:
    from graphmem.preflight.plan import Plan
    from graphmem.preflight.rows import PlanRow

__all__ = ["PLAN_RENDERERS", "plan_to_dict", "render_plan_json", "render_plan_table"]


def _extra(row: PlanRow) -> str:
    if row.extra_compute is None:
        return "?"
    return "0" if abs(row.extra_compute) < 5e-4 else f"{row.extra_compute:+.1%}"


def _changes_as_options(changes: Mapping[str, Any]) -> dict[str, Any]:
    """A row's changes as the options write them: ``parallel`` as ``--parallel`` takes it
    ("fsdp=8"), FSDP2 kept unsharded after forward as ``reshard_after_forward: false``
    (``--reshard-after-forward false``)."""
    out = dict(changes)
    if "parallel" in out:
        text, _, keep = str(out["parallel"]).partition(":")
        out["parallel"] = text
        if keep:
            out["reshard_after_forward"] = False
    return out


def _row_to_dict(row: PlanRow) -> dict[str, Any]:
    # the two ranks are the ranking's keys (graphmem/preflight/ranking.py; docs/json-schema.md, "plan")
    return {"name": row.name, "changes": _changes_as_options(row.changes), "peak_bytes": row.peak_bytes,
            "saving_bytes": row.saving_bytes, "extra_compute": row.extra_compute, "fits": row.fits,
            "source": row.source, "effort_rank": row.effort, "departure_rank": row.departure, "note": row.note}


def plan_to_dict(plan: Plan, context: Context) -> dict[str, Any]:
    """The JSON object of ``graphmem plan`` (bytes; ``rows`` ranked, best first)."""
    return {**context_dict(context, plan.report), "inputs": list(plan.inputs), "device": plan.device,
            "mode": plan.mode, "metric": "reserved_peak_bytes" if plan.device == "cuda" else "peak_bytes",
            "world_size": plan.world_size, "world_source": plan.world_source or None,
            "fits_as_given": plan.baseline.fits, "headroom_bytes": plan.headroom_bytes,
            "budget_bytes": plan.budget.total_bytes, "budget": plan.budget.source,
            "margin": float(plan.budget.margin), "cap_bytes": plan.budget.cap_bytes,
            "baseline": _row_to_dict(plan.baseline), "rows": [_row_to_dict(r) for r in plan.rows],
            "train_peak_bytes": plan.train_peak_bytes, "inference_peak_bytes": plan.inference_peak_bytes,
            "bytes_per_sample": plan.bytes_per_sample, "explanation": plan.explanation,
            "skipped": list(plan.skipped), "policy": policy_to_dict(plan.policy) if plan.policy else None}


def _world_line(plan: Plan, context: Context) -> str:
    """What the plan assumed about the GPUs the job may use."""
    gpus = "GPUs" if plan.device == "cuda" else "processes"
    n = plan.world_size
    if n is None:
        return (f"{gpus}: one, as given (--world-size N adds ZeRO-1 and FSDP2 rows over up to N {gpus})"
                if plan.mode == "train" else f"{gpus}: one, as given")
    if plan.world_source == "--world-size":
        return (f"{gpus}: one (--world-size 1): no sharding rows" if n == 1 else
                f"{gpus}: up to {n} (--world-size {n}): ZeRO-1 and FSDP2 rows shard over them")
    spec = context.setup.parallel if context.setup is not None else None  # (the job's --parallel)
    more = (": rows that shard more than it does, over them" if any("parallel" in r.changes for r in plan.rows)
            else f": nothing shards more over {n} (--world-size N adds more {gpus})")
    return f"{gpus}: {n}, the job's own ({spelling('parallel')} {spec}){more}"


def _as_given(plan: Plan, fmt: Callable[[int], str]) -> str:
    share = f"{abs(plan.headroom_bytes) / plan.budget.total_bytes:.1%} of the budget"
    if plan.baseline.fits:
        more = "checkpointing leaves more room (below)" if plan.policy else "the rows below leave more room"
        return (f"as given: {fmt(plan.baseline.peak_bytes)}: fits as given with {fmt(plan.headroom_bytes)} headroom "
                f"({share}); nothing needs to change, {more}")
    return f"as given: {fmt(plan.baseline.peak_bytes)}, does not fit (short by {fmt(-plan.headroom_bytes)}, {share})"


def render_plan_table(plan: Plan, context: Context, units: str = "auto") -> str:
    """Header, what was assumed, the ranked what-if table, footnotes, skipped remedies, the explanation."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    mode = context.mode if plan.mode == "generate" else plan.mode  # the context says what is generated
    shown = replace(context, inputs=plan.inputs, device=plan.device, mode=mode)
    head = "\n".join([header("plan", shown, plan.report, fmt=fmt) + "\n",
                      f"budget {fmt(plan.budget.total_bytes)} ({plan.budget.source}), margin "
                      f"{float(plan.budget.margin):.0%}: peaks up to {fmt(plan.budget.cap_bytes)} fit",
                      *([COMPARED_NOTE] if plan.device == "cuda" else []),
                      *([] if plan.policy else [_world_line(plan, context)]),
                      textwrap.fill(_as_given(plan, fmt), width=100)])
    if plan.policy is not None:
        parts = [head, policy_section(plan.policy, fmt)]
        if plan.explanation:
            parts.append("Why\n" + textwrap.fill(plan.explanation, width=100))
        return "\n\n".join(parts) + "\n"
    rows: list[list[Any]] = []
    notes: list[str] = []
    for i, row in enumerate(plan.rows, 1):
        mark = f" [{len(notes) + 1}]" if row.note else ""
        if row.note:
            notes.append(f"[{len(notes) + 1}] {row.note}")
        rows.append([i, row.name + mark, fmt(row.peak_bytes), fmt(row.saving_bytes), _extra(row),
                     "yes" if row.fits else "no", row.source])
    table = tabulate(rows, tablefmt="simple",
                     headers=["#", "what to change", "peak", "saving", "extra compute", "fits", "source"])
    parts = [head, table, "\n".join(notes)]
    parts.append(textwrap.fill(f"{RANKING_RULE} analysis: the job with the change, analysed as graphmem check "
                               "analyses it. formula: computed from this analysis's bytes, not executed "
                               "(docs/preflight.md).", width=100))
    if plan.skipped:
        parts.append("Not analysed:\n" + "\n".join(f"- {s}" for s in plan.skipped))
    if plan.explanation:
        parts.append("Why\n" + textwrap.fill(plan.explanation, width=100))
    return "\n\n".join(p for p in parts if p) + "\n"


def render_plan_json(plan: Plan, context: Context, units: str = "auto") -> str:
    return json.dumps(plan_to_dict(plan, context), indent=2) + "\n"


PLAN_RENDERERS: dict[str, Callable[..., str]] = {"table": render_plan_table, "json": render_plan_json}
