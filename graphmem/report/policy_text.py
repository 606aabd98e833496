"""Stage 4 for ``graphmem plan --policy``: the checkpointing policy as text (a section of the plan's
table) and as JSON (the plan's ``policy`` field).  Sizes in bytes in JSON, by ``--units`` in text."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from graphmem.job.grammar import format_blocks, format_save_in, format_units, grouped_by_names
from graphmem.job.option import spelling
from graphmem.report.policy_file import options_of, torchtitan_reshard, torchtitan_settings

if TYPE_CHECKING:
    from graphmem.preflight.policy.search import CheckpointChoice, PolicyPlan, Sharding

__all__ = ["choice_to_dict", "policy_section", "policy_to_dict", "sharding_to_dict"]


def _blocks(choice: CheckpointChoice) -> str:
    """``0-3`` (``0-1, 2-3 selective`` where some keep outputs; ``0 keeping attn.proj:matmuls``
    where one keeps outputs op by op)."""
    own = dict(choice.kept)
    whole = format_blocks([b for b in choice.blocks if b not in choice.selective and b not in own])
    kept = format_blocks(choice.selective)
    finer = [f"{format_blocks(blocks)} keeping {', '.join(names)}" for names, blocks in grouped_by_names(choice.kept)]
    parts = (f"{whole} whole" if whole and (kept or finer) else whole, f"{kept} selective" if kept else "", *finer)
    return "; ".join(p for p in parts if p) or "none"


def _fine(choice: CheckpointChoice) -> tuple[int, ...]:
    """The blocks that keep some outputs (selective, or op by op)."""
    return (*choice.selective, *(block for block, _ in choice.kept))


def choice_to_dict(choice: CheckpointChoice) -> dict[str, Any]:
    return {"blocks": list(choice.blocks), "checkpoint_blocks": format_blocks(choice.blocks),
            "selective": list(choice.selective), "checkpoint_save_blocks": format_blocks(choice.selective),
            "peak_bytes": choice.peak_bytes, "predicted_bytes": choice.predicted_bytes,
            "recompute_flops": choice.recompute_flops, "extra_compute": choice.extra_compute, "fits": choice.fits,
            "gathered_bytes": choice.gathered_bytes, "recompute_cost": choice.recompute_cost,
            "kept": {str(block): list(names) for block, names in choice.kept},
            "keep_units": list(choice.keep_units), "fsdp_keep_units": format_blocks(choice.keep_units),
            "checkpoint_save_in": format_save_in(choice.kept)}


def sharding_to_dict(sharding: Sharding) -> dict[str, Any]:
    """FSDP2's settings chosen with the blocks, and each setting searched."""
    return {"parallel": sharding.parallel, "fsdp_units": list(sharding.units),
            "reshard_after_forward": sharding.reshard_after_forward,
            "torchtitan_fsdp_reshard_after_forward": torchtitan_reshard(sharding.reshard_after_forward),
            "options": [{"reshard_after_forward": o.reshard_after_forward, "fsdp_units": list(o.units),
                         "chosen": choice_to_dict(o.chosen) if o.chosen else None, "lowest": choice_to_dict(o.lowest),
                         "gathered_bytes": o.gathered_bytes, "saved_bytes": o.saved_bytes}
                        for o in sharding.options],
            "finer_units_tried": None if sharding.probed is None else {
                "fsdp_units": list(sharding.probed[0]), "peak_bytes": sharding.probed[1],
                "own_units_peak_bytes": sharding.probed[2]}}


def policy_to_dict(policy: PolicyPlan) -> dict[str, Any]:
    """The JSON object of ``plan --policy``'s choice (``chosen`` null when none fits)."""
    chosen = policy.chosen
    return {"block_class": policy.block_class, "block_paths": list(policy.block_paths),
            "fits": chosen is not None,
            "chosen": choice_to_dict(chosen) if chosen is not None else None,
            "per_block": choice_to_dict(policy.per_block) if policy.per_block is not None else None,
            "lowest": choice_to_dict(policy.lowest), "front": [choice_to_dict(c) for c in policy.front],
            "front_size": policy.front_size, "baseline_peak_bytes": policy.baseline_bytes,
            "torchtitan": torchtitan_settings((chosen or policy.lowest).blocks, policy.blocks,
                                              _fine(chosen or policy.lowest)),
            "save": list(policy.save), "saved_ops": list(policy.saved_ops),
            "exact": policy.exact, "notes": list(policy.notes), "solver": policy.solver,
            "cost_model": {"unit": policy.cost_unit, "description": policy.cost_model},
            "recordings": policy.recordings, "analyses": policy.analyses,
            "sharding": sharding_to_dict(policy.sharding) if policy.sharding else None}


def _verdict(policy: PolicyPlan, fmt: Callable[[int], str]) -> str:
    budget = policy.budget
    chosen, lowest = policy.chosen, policy.lowest
    if chosen is None:
        short = budget.required_bytes(lowest.peak_bytes) - budget.total_bytes
        return (f"NO CHOICE FITS: the lowest peak any choice of the {policy.blocks} {policy.block_class} modules "
                f"reaches is {fmt(lowest.peak_bytes)} (blocks {_blocks(lowest)} checkpointed, "
                f"{lowest.extra_compute:+.1%} compute), short by {fmt(short)}; "
                "checkpointing alone cannot make it fit: graphmem plan without --policy lists the other remedies")
    if not chosen.blocks:
        return (f"FITS with no block checkpointed{_kept_params(policy, fmt)}: {fmt(chosen.peak_bytes)}, "
                f"{fmt(budget.total_bytes - budget.required_bytes(chosen.peak_bytes))} headroom"
                + (f". Run it: {options_of(policy, chosen)}" if policy.sharding else ""))
    kept = f", keeping {', '.join(policy.save)} in those marked selective" if chosen.selective else ""
    kept += _kept_params(policy, fmt)
    of = f"{len(chosen.blocks)} of {policy.blocks} {policy.block_class}{kept}"
    return (f"CHECKPOINT BLOCKS {_blocks(chosen)} ({of}): "
            f"peak {fmt(chosen.peak_bytes)} (analysed), fits with "
            f"{fmt(budget.total_bytes - budget.required_bytes(chosen.peak_bytes))} headroom; recomputes "
            f"{chosen.recompute_flops:,} FLOPs ({chosen.extra_compute:+.1%} compute{_time(policy, chosen)}). The "
            "least recompute that "
            f"fits{_ops_kept(chosen)}. Run it: {options_of(policy, chosen)}")


def _time(policy: PolicyPlan, choice: CheckpointChoice) -> str:
    """``; a roofline estimate of 12.3 ms ...`` where the plan's cost is a roofline time."""
    if policy.cost_unit != "ns":
        return ""
    return f"; by a roofline estimate {choice.recompute_cost / 1e6:,.1f} ms over the two recorded iterations"


def _refined(chosen: CheckpointChoice) -> str:
    """What the greedy steps added to a point of the front: ops' outputs, units' parameters."""
    return " and ".join(([] if not chosen.kept else ["keeping single ops' outputs"])
                        + ([] if not chosen.keep_units else [f"{format_units(chosen.keep_units)} keeping parameters"]))


def _ops_kept(chosen: CheckpointChoice) -> str:
    return " block by block, then single ops' outputs kept where the budget leaves room" if chosen.kept else ""


def _kept_params(policy: PolicyPlan, fmt: Callable[[int], str]) -> str:
    """``, FSDP2 keeping ...`` where the plan keeps the units' parameters after forward."""
    sharding = policy.sharding
    chosen = policy.chosen
    if sharding is not None and chosen is not None and chosen.keep_units:
        default = (policy.per_block or chosen).gathered_bytes
        its = "its" if len(chosen.keep_units) == 1 else "their"
        return (f", FSDP2 {format_units(chosen.keep_units)} keeping {its} parameters after forward "
                f"({fmt(default - chosen.gathered_bytes)} less all-gathered per rank per step)")
    if sharding is None or sharding.reshard_after_forward is not False:
        return ""
    saved = next(o.saved_bytes for o in sharding.options if o.reshard_after_forward is False and sharding.taken(o))
    if len(sharding.options) == 1:  # --reshard-after-forward false given: nothing compared
        return ", every FSDP2 unit keeping its parameters after forward (reshard_after_forward=False, as given)"
    return (f", every FSDP2 unit keeping its parameters after forward (reshard_after_forward=False: "
            f"{fmt(saved)} less all-gathered per rank per step)")


_SETTING = {None: "resharded (FSDP2's default)", False: "kept until backward", True: "resharded, the root too"}


def _sharding(sharding: Sharding, fmt: Callable[[int], str]) -> str:
    """Each reshard_after_forward setting searched, with its own checkpointing choice and costs."""
    rows = []
    layouts = len({option.units for option in sharding.options}) > 1
    for option in sharding.options:
        made = option.chosen or option.lowest
        units = f"; {format_units(made.keep_units)} kept" if made.keep_units else ""
        classes = f"{', '.join(option.units)}: " if layouts else ""
        rows.append([classes + _SETTING[option.reshard_after_forward] + units, _blocks(made), fmt(made.peak_bytes),
                     f"{made.recompute_flops:,}", fmt(option.gathered_bytes),
                     "yes" if option.chosen else "no (lowest peak)", "<- chosen" if sharding.taken(option) else ""])
    own = (sharding.options[0].units if sharding.options else ()) or sharding.units
    title = (f"Parameters after forward, with {spelling('parallel')} {sharding.parallel} (FSDP2 units: "
             f"{', '.join(own)}): ")
    if layouts:
        finer = next(o.units for o in sharding.options if o.units != own)
        title = (f"FSDP2's units and their parameters after forward, with {spelling('parallel')} "
                 f"{sharding.parallel}: units "
                 f"{', '.join(finer)} split the job's own ({', '.join(own)}), fewer unsharded parameters at a time "
                 "(searched where the job's own needed recompute and, with the blocks these needed checkpointed, "
                 "the finer units' peak was lower); ")
    elif sharding.probed is not None:
        classes_tried, peak, theirs = sharding.probed
        title += (f"finer units ({', '.join(classes_tried)}), with the blocks these need checkpointed, peak at "
                  f"{fmt(peak)}, not below {fmt(theirs)}: not searched further; ")
    title = textwrap.fill(
        title + "each setting with its own least-recompute checkpointing, analysed. Chosen: the least recompute that "
        "fits, then the fewest bytes all-gathered again in backward (prefetched, that communication mostly overlaps "
        "compute; a recomputed forward does not)" + (", then the job's own units (fewer collectives)" if layouts
                                                     else ""), width=100)
    return title + "\n" + str(tabulate(rows, tablefmt="simple", headers=[
        "parameters", "blocks checkpointed", "peak", "recomputed FLOPs", "all-gathered in backward", "fits", ""]))


def _curve(policy: PolicyPlan, fmt: Callable[[int], str]) -> str:
    def row(point: CheckpointChoice, mark: str) -> list[Any]:
        extra = "0" if not point.recompute_flops else f"{point.extra_compute:+.1%}"
        timed = [f"{point.recompute_cost / 1e6:,.1f} ms"] if roofline else []
        return [_blocks(point), len(point.blocks), fmt(point.peak_bytes), f"{point.recompute_flops:,}", *timed, extra,
                "yes" if point.fits else "no", mark]

    roofline = policy.cost_unit == "ns"

    rows = []
    chosen, base = policy.chosen, policy.per_block or policy.chosen
    for point in policy.front:
        if base is None or point != base:
            rows.append(row(point, ""))
        elif chosen is not None and (chosen.kept or chosen.keep_units):
            rows += [row(point, ""), row(chosen, f"<- chosen: the row above, {_refined(chosen)}")]
        else:
            rows.append(row(point, "<- chosen"))
    shown = (f"{len(policy.front)} points, all analysed" if len(policy.front) == policy.front_size
             else f"{len(policy.front)} of its {policy.front_size} points, analysed (--front-points N for more)")
    title = textwrap.fill("Memory against recompute: the front, where no choice has both less recompute and a "
                          f"lower peak ({shown})", width=100)
    return title + "\n" + str(tabulate(rows, tablefmt="simple", headers=[
        "blocks checkpointed", "blocks", "peak", "recomputed FLOPs", *(["recompute (roofline)"] if roofline else []),
        "extra compute", "fits", ""]))


def _recorded(policy: PolicyPlan) -> str:
    if not policy.save:
        return "no block, every block, every even and every odd block checkpointed"
    return ("no block, every block whole and every block selective, and each two of the three alternating on "
            "even and odd blocks")


def _how(policy: PolicyPlan) -> str:
    same = all(p.predicted_bytes == p.peak_bytes for p in policy.front if p.blocks)
    exact = ("the composite equals the analysis for every choice shown" if same
             else "the composite differs from the analysis for some choices shown (peak_bytes decides)")
    notes = f" Not exact: {'; '.join(policy.notes)}." if policy.notes else ""
    if policy.sharding is not None:
        notes += (f" With {spelling('parallel')} {policy.sharding.parallel} the recordings are every distinct rank's "
                  "under "
                  "FSDP2 (a peak is the rank that needs the most), made for each setting of the parameters after "
                  "forward; the front is the chosen setting's.")
    counted = "" if policy.cost_unit == "FLOPs" else f" (recompute counted as {policy.cost_model})"
    return textwrap.fill(
        f"How: {policy.recordings} recordings of the step ({_recorded(policy)}) give the peak of every choice of the "
        f"{policy.blocks} {policy.block_class} modules, storage by "
        f"storage (graphmem/preflight/policy/composite.py); {policy.solver} picks the least recompute under the "
        f"budget{counted}; every peak above is an analysis of the job with those blocks checkpointed "
        f"({policy.analyses} more analyses); {exact}.{_finer(policy)}{notes} Extra compute: recomputed FLOPs over "
        "the step's (torch.utils.flop_counter's formulas).", width=100)


def _finer(policy: PolicyPlan) -> str:
    chosen = policy.chosen
    if chosen is None or not chosen.kept:
        return ""
    return (" Then, in the chosen blocks, the outputs of single ops (the most FLOPs per byte first) were kept "
            "where an analysis found the step still fits and recomputes less (a greedy step after the per-block "
            "optimum).")


def policy_section(policy: PolicyPlan, fmt: Callable[[int], str]) -> str:
    """The policy's verdict, the front as a table, and how it was found."""
    parts = [textwrap.fill(_verdict(policy, fmt), width=100), _curve(policy, fmt), _how(policy)]
    if policy.sharding is not None:
        parts.insert(1, _sharding(policy.sharding, fmt))
    return "\n\n".join(parts)
