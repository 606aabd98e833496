"""Stage 4: the JSON renderer.  MemoryReport -> a stable, documented JSON document.

The schema is documented in docs/json-schema.md; sizes are always int bytes.
"""

from __future__ import annotations

import json
from typing import Any

from graphmem.types import MemoryReport, ModeReport

__all__ = ["report_to_dict", "render_json", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


def _mode_to_dict(m: ModeReport) -> dict[str, Any]:
    data: dict[str, Any] = {
        "peak_bytes": m.peak_bytes,
        "peak": {"op": m.peak.op, "module": m.peak.module, "phase": m.peak.phase,
                 "iteration": m.peak.iteration, "step": m.peak.step},
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
                    activations_bytes=m.activations_bytes)
    return data


def report_to_dict(report: MemoryReport) -> dict[str, Any]:
    """The JSON document as Python data; modes not analysed are absent."""
    from graphmem import __version__

    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "graphmem_version": __version__,
        "target": report.target,
        "device": report.device,
        "inputs": list(report.inputs),
    }
    if report.inference is not None:
        data["inference"] = _mode_to_dict(report.inference)
    if report.train is not None:
        data["train"] = _mode_to_dict(report.train)
    if report.ratio is not None:
        data["train_to_inference_ratio"] = round(report.ratio, 4)
    return data


def render_json(report: MemoryReport, units: str = "auto") -> str:
    """Indented JSON; ``units`` is accepted for a uniform renderer signature and ignored."""
    return json.dumps(report_to_dict(report), indent=2)
