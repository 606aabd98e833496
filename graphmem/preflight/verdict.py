"""``graphmem check``: will the job fit its budget?

Input: a ``Job`` with concrete inputs and a ``Budget``.  Output: a frozen ``CheckResult``.

The verdict compares what the device must hold (graphmem/preflight/footprint.py: on the CUDA
target the caching allocator's reserved peak plus the CUDA context and NCCL's buffers) with
the budget; ``metric`` (``check --metric``) may name another of the CUDA target's numbers:
the allocated peak (plus the same memory outside the allocator) or the nvidia-smi estimate.
On the CUDA target, when that does not fit but the allocated peak would (the tensors fit; the
allocator's cached segments do not), the job is analysed again with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (segments that grow in place instead of
new ones beside the old: the remedy PyTorch's out-of-memory message names for fragmentation),
and the result says whether that fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from graphmem.job.job import Job
from graphmem.job.spec import validate_inputs
from graphmem.memory.results import MemoryReport
from graphmem.preflight.budget import DEFAULT_METRIC, Budget
from graphmem.preflight.footprint import Footprint, expandable_conf, footprint_of
from graphmem.preflight.search import predict

__all__ = ["METRIC_NAMES", "CheckResult", "Expandable", "check", "judge"]


@dataclass(frozen=True, slots=True)
class Expandable:
    """The job analysed again with expandable segments (bytes)."""

    alloc_conf: str          # the PYTORCH_CUDA_ALLOC_CONF analysed
    footprint: Footprint
    fits: bool
    required_bytes: int      # its needed bytes with the margin

    def headroom_bytes(self, budget: Budget) -> int:
        return budget.total_bytes - self.required_bytes


@dataclass(frozen=True, slots=True)
class CheckResult:
    """``graphmem check``'s answer (bytes).

    Attributes:
        peak_bytes: the bytes compared with the budget (``footprint.needed_bytes``: CPU the
            tensor bytes at the peak; CUDA the reserved peak + CUDA context + NCCL buffers).
        required_bytes: ``peak_bytes`` with the margin.
        metric: what ``peak_bytes`` is: "peak_bytes" (cpu); on cuda, by ``check --metric``,
            "reserved_peak_bytes" (the default), "allocated_peak_bytes" (each with what lives
            outside the allocator added) or "nvidia_smi_estimate_bytes".
        footprint: the allocated and reserved peaks and what lives outside the allocator.
        expandable: on CUDA, when the reserved peak does not fit but the allocated one
            does: the same job analysed with expandable segments (None otherwise).
    """

    fits: bool
    peak_bytes: int
    required_bytes: int
    budget: Budget
    metric: str
    footprint: Footprint
    report: MemoryReport
    expandable: Expandable | None = None

    @property
    def headroom_bytes(self) -> int:
        """Budget left after the compared bytes and their margin; negative: the shortfall."""
        return self.budget.total_bytes - self.required_bytes

    @property
    def reserved_peak_bytes(self) -> int | None:
        return self.footprint.reserved_peak_bytes

    @property
    def allocated_required_bytes(self) -> int:
        """The allocated peak plus what lives outside the allocator, with the margin."""
        return self.budget.required_bytes(self.footprint.allocated_needed_bytes)

    @property
    def allocated_fits(self) -> bool:
        """Whether the allocated peak (plus what lives outside the allocator) fits."""
        return self.budget.fits(self.footprint.allocated_needed_bytes)


# check --metric -> the name of what is compared, in the JSON's "metric"
METRIC_NAMES = {"allocated": "allocated_peak_bytes", "reserved": "reserved_peak_bytes",
                "nvidia-smi": "nvidia_smi_estimate_bytes"}


def check(job: Job, budget: Budget, metric: str = DEFAULT_METRIC) -> CheckResult:
    """Will ``job`` fit ``budget``?  One analysis; two on the CUDA target when only the
    allocator's cached segments stand in the way (see the module docstring).

    Args:
        job: what to analyse.
        budget: the bytes available and the margin.
        metric: on the CUDA target, which number is compared (``graphmem.preflight.budget.METRICS``).

    Returns:
        The verdict, the bytes compared and the same with the margin, in bytes.
    """
    if job.generate is None:
        validate_inputs(job.inputs.specs, symbolic=False)
    prediction = predict(job)
    return judge(prediction.report, job.mode, budget,
                 lambda conf: predict(replace(job, target=job.target.with_alloc_conf(conf)),
                                      checkpoint_comparison=False).report,
                 job.target.alloc_conf, metric)


def judge(report: MemoryReport, mode: str, budget: Budget, again: Callable[[str], MemoryReport],
          alloc_conf: str | None = None, metric: str = DEFAULT_METRIC) -> CheckResult:
    """The verdict on an analysed ``report`` (its ``mode``), comparing ``metric``'s bytes:
    ``again(conf)`` is the same job analysed with the allocator settings ``conf``, asked for
    when only the allocator's cached segments stand in the way; ``alloc_conf``: the settings
    ``report`` was analysed with."""
    found = footprint_of(report, mode)
    compared = found.compared_bytes(metric)
    fits = budget.fits(compared)
    result = CheckResult(fits=fits, peak_bytes=compared, required_bytes=budget.required_bytes(compared),
                         budget=budget, metric=METRIC_NAMES[metric] if found.cuda else "peak_bytes",
                         footprint=found, report=report)
    # expandable segments bring the reserved peak down to the allocated one: no help to the allocated metric
    if fits or not found.cuda or found.expandable_segments or not result.allocated_fits or metric == "allocated":
        return result
    conf = expandable_conf(alloc_conf)
    second = footprint_of(again(conf), mode)
    expandable = Expandable(alloc_conf=conf, footprint=second, fits=budget.fits(second.compared_bytes(metric)),
                            required_bytes=budget.required_bytes(second.compared_bytes(metric)))
    return replace(result, expandable=expandable)
