"""Stage 4: the JSON renderer.  MemoryReport -> a stable, documented JSON document.

The schema is documented in docs/json-schema.md; sizes are always int bytes.
"""

from __future__ import annotations

import json
from typing import Any

from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.report.cuda_section import cuda_json
from graphmem.report.generate_section import generate_json
from graphmem.report.header import Settings, settings_to_dict
from graphmem.report.modules import module_rows, top_tensors
from graphmem.report.parallel_section import parallel_json
from graphmem.report.program_section import program_files_json

__all__ = ["report_to_dict", "render_json", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2  # 2: peak.iteration counts from 1, as the text reports do (docs/json-schema.md)


def _mode_to_dict(m: ModeReport) -> dict[str, Any]:
    data: dict[str, Any] = {
        "peak_bytes": m.peak_bytes,
        "peak": {"op": m.peak.op, "module": m.peak.module, "phase": m.peak.phase,
                 "iteration": m.peak.iteration + 1, "step": m.peak.step,
                 **({"line": _line(m, m.peak.step)} if _line(m, m.peak.step) else {})},
        "breakdown": {str(k): v for k, v in m.breakdown.items()},
        "params_bytes": m.params_bytes,
        "buffers_bytes": m.buffers_bytes,
        "inputs_bytes": m.inputs_bytes,
        "phases": {p.phase: {"peak_bytes": p.peak_bytes, "step": p.step} for p in m.phases},
        "num_ops": m.num_ops,
        "unmodeled_ops": list(m.unmodeled_ops),
    }
    if m.mode == "train":
        data.update(optimizer=m.optimizer, grads_bytes=m.grads_bytes,
                    optimizer_state_bytes=m.optimizer_state_bytes,
                    optimizer_state_source="formula" if m.optimizer in FORMULA_OPTIMIZERS else "recorded",
                    activations_bytes=m.activations_bytes,
                    first_step_peak_bytes=m.iteration_peaks[0],
                    steady_state_peak_bytes=m.iteration_peaks[-1],
                    flops=m.flops, recompute_flops=m.recompute_flops)
    data["assumptions"] = list(m.assumptions)
    data["unseen_inputs"] = list(m.trace.unseen_inputs)  # non-empty: the peak is an upper bound
    return data


def report_to_dict(report: MemoryReport, *, depth: int = 2, top: int = 10,
                   setup: Settings | None = None) -> dict[str, Any]:
    """The JSON document as Python data; modes not analysed are absent.  Each mode's
    ``modules`` cut the module tree at ``depth``; ``top_tensors`` lists ``top`` storages;
    ``setup`` (the job's settings that change its numbers) is the ``setup`` object."""
    from graphmem import __version__

    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "graphmem_version": __version__,
        "target": report.target,
        **({"program": report.program} if report.program else {}),
        **program_files_json(report),
        "device": report.device,
        "inputs": list(report.inputs),
    }
    if report.parallel is not None:
        data["parallel"] = report.parallel
    if setup is not None:
        data["setup"] = settings_to_dict(setup, report)
    if report.inference is not None:
        data["inference"] = _mode_to_dict(report.inference)
    if report.train is not None:
        data["train"] = _mode_to_dict(report.train)
    if report.train is not None and report.trained is not None:
        data["train"].update(trainable_parameters=report.trained.trainable,
                             total_parameters=report.trained.total)
    if report.train_without_checkpoint is not None:
        data["train_without_checkpoint"] = _mode_to_dict(report.train_without_checkpoint)
    for key in ("inference", "train"):
        if key in data:
            data[key].update(where_memory_goes(getattr(report, key), depth, top))
            data[key].update(cuda_json(report, getattr(report, key)))
            data[key].update(parallel_json(getattr(report, key)))
    if report.generate is not None:
        data["generate"] = generate_json(report, report.generate)
    if report.gpu is not None:
        data["gpu"] = {"name": report.gpu.name, "total_memory_bytes": report.gpu.total_memory_bytes,
                       "compute_capability": list(report.gpu.compute_capability)}
    if report.ratio is not None:
        data["train_to_inference_ratio"] = round(report.ratio, 4)
    return data


def render_json(report: MemoryReport, units: str = "auto", *, depth: int = 2, top: int = 10,
                setup: Settings | None = None) -> str:
    """Indented JSON; ``units`` is accepted for a uniform renderer signature and ignored."""
    return json.dumps(report_to_dict(report, depth=depth, top=top, setup=setup), indent=2)


def where_memory_goes(m: ModeReport, depth: int = 2, top: int = 10) -> dict[str, Any]:
    """``module_depth``, ``modules`` (per-module bytes) and ``top_tensors`` for one mode."""
    modules = [{"module": r.module, "params_bytes": r.params_bytes, "grads_bytes": r.grads_bytes,
                "optimizer_state_bytes": r.optimizer_state_bytes, "activations_bytes": r.activations_bytes,
                "peak_bytes": r.peak_bytes} for r in module_rows(m, depth)]
    tensors = [{"nbytes": t.nbytes, "shape": list(t.shape), "dtype": t.dtype, "category": str(t.category),
                "name": t.label, "op": t.op, "created": t.created, "module": t.module, "dies": t.dies,
                **({"line": _line(m, t.created)} if _line(m, t.created) else {})}
               for t in top_tensors(m, top)]
    return {"module_depth": depth, "modules": modules, "top_tensors": tensors}


def _line(m: ModeReport, step: int) -> str:
    """graphmem run: the program's file:line that ran op ``step`` ("" elsewhere)."""
    return m.trace.ops[step].line if 0 <= step < len(m.trace.ops) else ""
