"""Stage 4 for ``graphmem plan --policy --emit-policy FILE``: the chosen checkpointing policy as a
small Python module the user pastes or imports.

Input: a ``PolicyPlan`` and how the job was described.  Output: the module's text.  It holds the
blocks to checkpoint, ``apply_policy(model)`` (each chosen block's forward under non-reentrant
``torch.utils.checkpoint``, exactly as graphmem analysed it: graphmem.trace.step.checkpointing),
a ``policy_fn`` for ``create_selective_checkpoint_contexts`` (the blocks checkpointed selectively
keep the outputs of the ops ``--policy-save`` names, recomputing the rest), torchtitan's
activation-checkpointing settings where its config can say the same, and for a transformers model
the calls of its own checkpointing.
The text imports only torch; it is checked by running it (tests/integration/test_checkpoint_policy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pprint import pformat
from typing import TYPE_CHECKING

from graphmem.job.grammar import format_units
from graphmem.job.option import spelling
from graphmem.units import format_bytes

if TYPE_CHECKING:
    from graphmem.preflight.policy.search import CheckpointChoice, PolicyPlan, Sharding

__all__ = ["options_of", "render_policy_module", "torchtitan_reshard", "torchtitan_settings"]


def torchtitan_settings(blocks: Sequence[int], total: int, selective: Sequence[int] = ()) -> dict[str, str] | None:
    """torchtitan's ``[activation_checkpoint]`` settings that checkpoint exactly ``blocks`` of
    ``total`` layers, or None where its config cannot say it.  torchtitan (``apply_ac``) wraps
    every layer with ``mode = "full"``, and with ``mode = "selective"`` and a number k as
    ``selective_ac_option`` the layers whose count from 1 is a multiple of k (0-based: k-1,
    2k-1, ...); ``"none"`` wraps none.  Its op-level selective mode saves every second matmul and
    the attention outputs, which no choice here is: a choice with ``selective`` blocks is None."""
    if selective:
        return None
    chosen = set(blocks)
    if not chosen:
        return {"mode": "none"}
    if chosen == set(range(total)):
        return {"mode": "full"}
    for every in range(2, total + 1):
        if chosen == {i for i in range(total) if (i + 1) % every == 0}:
            return {"mode": "selective", "selective_ac_option": str(every)}
    return None


def torchtitan_reshard(reshard_after_forward: bool | None) -> str:
    """torchtitan's ``[parallelism] fsdp_reshard_after_forward`` for a ``reshard_after_forward``
    setting: ``never`` (False), ``always`` (True), ``default`` (None: FSDP2's default)."""
    return {False: "never", True: "always", None: "default"}[reshard_after_forward]


def _torchtitan_lines(blocks: Sequence[int], total: int, selective: Sequence[int]) -> list[str]:
    settings = torchtitan_settings(blocks, total, selective)
    if settings is None:
        return ["# torchtitan: its config checkpoints every layer (mode = \"full\") or every k-th (mode =",
                "# \"selective\", selective_ac_option = \"k\": layers k-1, 2k-1, ...); this choice is neither.",
                "# Call apply_policy(model) in your parallelize function instead of apply_ac.",
                "TORCHTITAN_ACTIVATION_CHECKPOINT = None"]
    toml = [f'# {key} = "{value}"' for key, value in settings.items()]
    return ["# torchtitan: the same choice as its job config's [activation_checkpoint] section:",
            "# [activation_checkpoint]", *toml,
            f"TORCHTITAN_ACTIVATION_CHECKPOINT = {settings!r}"]


def _spelled() -> dict[str, str]:
    """The options the module's comments name, spelled as the job's tree spells them."""
    return {f"option_{keyword}": spelling(keyword) for keyword in (
        "checkpoint_blocks", "checkpoint_save_blocks", "checkpoint_save_in", "parallel", "fsdp_keep_units")}


_HEAD = '''"""Activation checkpointing chosen by graphmem plan --policy: the least recompute whose peak
fits the budget, block by block{then}.

{summary}
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# the blocks are the modules of this class, in model.modules() order (0-based)
BLOCK_CLASS = {cls!r}
BLOCKS = {count}  # in the model analysed
CHECKPOINTED = {blocks!r}  # as graphmem's {option_checkpoint_blocks} {spec}
# of those, the blocks checkpointed selectively: they keep the outputs of SAVE_OPS and recompute
# the rest ({option_checkpoint_save_blocks}); the others recompute their whole forward
SELECTIVE = {selective!r}
SAVE_OPS = {save_ops!r}
# blocks that keep outputs op by op ({option_checkpoint_save_in} {save_in}): block -> (submodule path inside
# the block, "" for the whole block; the aten ops whose outputs it keeps while that submodule runs)
KEPT = {kept}
'''

_BODY = '''

def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: its modules of BLOCK_CLASS (or of a class built on it, as FSDP2's
    fully_shard makes FSDPBlock from Block), in order."""
    def names(module: torch.nn.Module) -> set[str]:
        return {{type(module).__name__, *(base.__name__ for base in type(module).__bases__)}}
    return [m for m in model.modules() if BLOCK_CLASS in names(m)]


_SAVED = frozenset(getattr(torch.ops.aten, name.split(".")[1]) for name in SAVE_OPS)


def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-op policy of torch.utils.checkpoint.create_selective_checkpoint_contexts in the
    SELECTIVE blocks: the outputs of SAVE_OPS are kept, every other op is recomputed."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn() -> Any:
    """``context_fn`` for torch.utils.checkpoint.checkpoint: selective checkpointing with policy_fn."""
    return create_selective_checkpoint_contexts(policy_fn)


def _running(forward: Any, count: list[int], *args: Any, **kwargs: Any) -> Any:
    count[0] += 1
    try:
        return forward(*args, **kwargs)
    finally:
        count[0] -= 1


def kept_context_fn(block: torch.nn.Module, kept: Any) -> Any:
    """``context_fn`` for a KEPT block: an op keeps its output where it is one of a pair's ops and
    runs inside that pair's submodule (counted by wrapping the submodule's forward, so the
    recompute decides alike); every other op is recomputed."""
    scoped = []
    for path, names in kept:
        count = [0] if path else [1]
        if path:
            submodule = block.get_submodule(path)
            submodule.forward = functools.partial(_running, submodule.forward, count)
        scoped.append((count, frozenset(getattr(torch.ops.aten, name.split(".")[1]) for name in names)))

    def kept_policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = op.overloadpacket
        if any(count[0] and packet in ops for count, ops in scoped):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, kept_policy_fn)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _selective(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_policy(model: torch.nn.Module) -> torch.nn.Module:
    """Run each chosen block's forward under non-reentrant torch.utils.checkpoint, as graphmem
    analysed it; call before the optimizer is built (and before torch.compile or FSDP2).  A
    transformers model's KV cache is turned off while training, as its own checkpointing does."""
    found = blocks_of(model)
    if len(found) != BLOCKS:
        raise ValueError(f"the model has {{len(found)}} modules of class {{BLOCK_CLASS}}; this policy was chosen "
                         f"for {{BLOCKS}}")
    config = getattr(model, "config", None)
    if CHECKPOINTED and getattr(config, "use_cache", False):
        config.use_cache = False
    for index in CHECKPOINTED:
        block = found[index]
        if index in KEPT:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                              context_fn=kept_context_fn(block, KEPT[index]))
        else:
            block.forward = functools.partial(_selective if index in SELECTIVE else _checkpointed, block.forward)
    return model
'''

_TRANSFORMERS = '''

def enable_transformers_checkpointing(model: Any) -> Any:
    """The same choice with the transformers model's own checkpointing: turned on for every layer
    (non-reentrant), then off for the layers not chosen, and selective (context_fn) in SELECTIVE.
    Use it instead of apply_policy."""
    model.config.use_cache = False
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers 5 names it so
        enable(activation_checkpointing_kwargs={{"use_reentrant": False}})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    for index, layer in enumerate(blocks_of(model)):
        layer.gradient_checkpointing = index in CHECKPOINTED
        if index in KEPT:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False,
                                                                   context_fn=kept_context_fn(layer, KEPT[index]))
        elif index in SELECTIVE:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False,
                                                                   context_fn=context_fn)
    return model
'''


def _summary(policy: PolicyPlan, chosen: CheckpointChoice, described: str) -> str:
    budget = policy.budget
    return "\n".join([
        f"Job: {described}",
        f"Budget: {format_bytes(budget.total_bytes)} ({budget.source}), margin {float(budget.margin):.0%}: "
        f"peaks up to {format_bytes(budget.cap_bytes)} fit.",
        f"Analysed peak with this policy: {chosen.peak_bytes:,} B ({format_bytes(chosen.peak_bytes)}); "
        f"{'fits' if chosen.fits else 'DOES NOT FIT: the lowest peak any choice reaches'}.",
        f"As given (no block checkpointed): {policy.baseline_bytes:,} B ({format_bytes(policy.baseline_bytes)}).",
        f"Recomputed: {chosen.recompute_flops:,} FLOPs over the two recorded iterations "
        f"({chosen.extra_compute:+.1%} of the step's FLOPs).",
        *_sharding_lines(policy, chosen),
        f"Check it: graphmem analyze ... {options_of(policy, chosen)}",
    ])


def _sharding_lines(policy: PolicyPlan, chosen: CheckpointChoice) -> list[str]:
    """Under --parallel fsdp=N: whose peak it is, and what keeping the parameters saves."""
    sharding = policy.sharding
    if sharding is None:
        return []
    kept = next((o for o in sharding.options if o.reshard_after_forward is False and sharding.taken(o)), None)
    if sharding.reshard_after_forward is False and kept is not None and len(sharding.options) > 1:
        how = (f"every FSDP2 unit keeps its parameters after forward: {kept.saved_bytes:,} B "
               f"({format_bytes(kept.saved_bytes)}) less all-gathered per rank per step.")
    elif sharding.reshard_after_forward is False:
        how = "every FSDP2 unit keeps its parameters after forward (as given)."
    elif sharding.reshard_after_forward is None and chosen.keep_units:
        which = "which keeps its" if len(chosen.keep_units) == 1 else "which keep their"
        how = (f"FSDP2's units reshard after forward but {format_units(chosen.keep_units)}, {which} parameters "
               "(KEEP_UNITS).")
    elif sharding.reshard_after_forward is None:
        how = "FSDP2's units reshard after forward (its default: every unit but the root)."
    else:
        how = "every FSDP2 unit, the root too, reshards after forward."
    units = ([f"FSDP2's units are {', '.join(sharding.units)}, finer than the job's own "
              f"({', '.join(sharding.options[0].units)}): fewer unsharded parameters at a time."]
             if sharding.finer else [])
    return [f"Peaks are per rank (the rank that needs the most) with {spelling('parallel')} {sharding.parallel};",
            how, *units]


def options_of(policy: PolicyPlan, chosen: CheckpointChoice) -> str:
    """The options that analyse ``chosen``: ``--checkpoint Block --checkpoint-blocks 0-3`` (and
    ``--checkpoint-save matmuls --checkpoint-save-blocks 2-3`` where some blocks are selective)."""
    from graphmem.job.job import command_line

    given: dict[str, object] = {}
    if chosen.blocks:
        given.update(checkpoint=policy.block_class, checkpoint_blocks=chosen.blocks)
    if chosen.selective:
        given.update(checkpoint_save=policy.save, checkpoint_save_blocks=chosen.selective)
    if chosen.kept:
        given.update(checkpoint_save_in=chosen.kept)
    sharding = policy.sharding
    if sharding is not None:
        given.update(parallel=sharding.parallel)
        if sharding.finer:
            given.update(fsdp_units=sharding.units)
        if sharding.reshard_after_forward is not None:
            given.update(reshard_after_forward=sharding.reshard_after_forward)
        if chosen.keep_units:
            given.update(fsdp_keep_units=chosen.keep_units)
    return command_line(**given) or "(as given)"


def save_in_option(kept: Sequence[tuple[int, Sequence[str]]]) -> str:
    """``--checkpoint-save-in``'s value as a shell takes it (quoted where it holds a ``;``)."""
    from graphmem.job.grammar import format_save_in

    text = format_save_in(kept)
    return f"'{text}'" if ";" in text else text


def kept_ops(kept: Sequence[tuple[int, Sequence[str]]]) -> dict[int, tuple[tuple[str, tuple[str, ...]], ...]]:
    """Per block of ``kept``, each name as (submodule path, the aten ops it names)."""
    from graphmem.job.step import split_save
    from graphmem.preflight.policy.search import saved_op_names

    return {block: tuple((split_save(name)[0], saved_op_names([split_save(name)[1]])) for name in names)
            for block, names in kept}


def _kept_text(kept: Sequence[tuple[int, Sequence[str]]]) -> str:
    """KEPT's value as Python, one line per block where it is long, aligned after ``KEPT = ``."""
    return pformat(kept_ops(kept), width=100).replace("\n", "\n" + " " * len("KEPT = "))


def _spec(blocks: Sequence[int]) -> str:
    from graphmem.job.grammar import format_blocks

    return format_blocks(blocks) or "(none)"


def render_policy_module(policy: PolicyPlan, described: str) -> str:
    """The Python module of ``policy``'s choice (the lowest peak when nothing fits).

    Args:
        policy: the plan's checkpointing policy.
        described: the job in words (target and inputs), for the module's docstring.
    """
    chosen = policy.chosen if policy.chosen is not None else policy.lowest
    then = ", then single ops' outputs kept where the budget leaves room" if chosen.kept else ""
    text = _HEAD.format(**_spelled(), summary=_summary(policy, chosen, described), then=then, cls=policy.block_class,
                        count=policy.blocks, blocks=tuple(chosen.blocks), spec=_spec(chosen.blocks),
                        selective=tuple(chosen.selective), save_ops=tuple(policy.saved_ops),
                        kept=_kept_text(chosen.kept),
                        save_in=save_in_option(chosen.kept) or "(none)")
    fine = (*chosen.selective, *(block for block, _ in chosen.kept))
    text += "\n".join(["", *_torchtitan_lines(chosen.blocks, policy.blocks, fine)]) + "\n"
    text += _BODY.format()
    if policy.transformers:
        text += _TRANSFORMERS.format()
    if policy.sharding is not None:
        text += _fsdp_text(policy.sharding, chosen)
    return text


_FSDP = '''

# FSDP2 (torch.distributed.fsdp.fully_shard) as graphmem analysed it with {option_parallel} {parallel}: each
# module of FSDP_UNITS a unit (in model.modules() order), then the root, all with these settings
FSDP_UNITS = {units!r}
# True: a unit frees its unsharded parameters after forward and all-gathers them again in backward;
# False: it keeps them until its backward; None: FSDP2's default (every unit but the root reshards)
RESHARD_AFTER_FORWARD = {reshard!r}
# these units (0-based, in model.modules() order among FSDP_UNITS) keep their parameters after forward
# whatever RESHARD_AFTER_FORWARD says (graphmem's {option_fsdp_keep_units})
KEEP_UNITS = {keep!r}
PARAM_DTYPE = {param!r}  # MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...); None: the parameters' own
REDUCE_DTYPE = {reduce!r}
# torchtitan: its job config's [parallelism] fsdp_reshard_after_forward = "{titan}" says the same of
# reshard_after_forward (its apply_fsdp picks its own units: the peak can differ from the analysed one)
TORCHTITAN_FSDP_RESHARD_AFTER_FORWARD = {titan!r}


def apply_fsdp(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 on ``model`` over ``mesh`` (torch.distributed.device_mesh.init_device_mesh), as
    graphmem analysed it: call after apply_policy and before the optimizer is built."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def dtype(name: Any) -> Any:
        return getattr(torch, name) if name else None

    kwargs = {{"mesh": mesh, "reshard_after_forward": RESHARD_AFTER_FORWARD,
              "mp_policy": MixedPrecisionPolicy(param_dtype=dtype(PARAM_DTYPE), reduce_dtype=dtype(REDUCE_DTYPE))}}
    units = [m for m in model.modules() if m is not model and type(m).__name__ in FSDP_UNITS]
    for index, unit in enumerate(units):
        fully_shard(unit, **{{**kwargs, **({{"reshard_after_forward": False}} if index in KEEP_UNITS else {{}})}})
    fully_shard(model, **kwargs)
    return model
'''


def _fsdp_text(sharding: Sharding, chosen: CheckpointChoice) -> str:
    """The module's FSDP2 part: the units, reshard_after_forward, apply_fsdp(model, mesh)."""
    return _FSDP.format(**_spelled(), parallel=sharding.parallel, units=tuple(sharding.units),
                        reshard=sharding.reshard_after_forward, keep=tuple(chosen.keep_units),
                        param=sharding.param_dtype,
                        reduce=sharding.reduce_dtype, titan=torchtitan_reshard(sharding.reshard_after_forward))
