"""Stage 4: a terminal sparkline of live bytes over the step.  ModeReport -> three text lines.

Input: one ModeReport.  Output: a line of block characters (one per op, or per run of ops
holding its highest value when there are more ops than columns), a line naming the phase
of each column (f forward, l loss, b backward, o optimizer; upper case in the second
iteration), and a caret under the column of the peak.
"""

from __future__ import annotations

from graphmem.memory.results import ModeReport
from graphmem.report.series import bucket_peaks
from graphmem.units import format_bytes

__all__ = ["BLOCKS", "PHASE_LETTERS", "render_sparkline", "sparkline"]

BLOCKS = "▁▂▃▄▅▆▇█"
PHASE_LETTERS = {"program": "p", "forward": "f", "loss": "l", "backward": "b", "optimizer": "o"}


def sparkline(values: tuple[int, ...] | list[int], low: int, high: int) -> str:
    """One block character per value, scaled linearly from ``low`` (▁) to ``high`` (█)."""
    span = high - low
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[top if span <= 0 else round((v - low) * top / span)] for v in values)


def render_sparkline(mode: ModeReport, units: str = "auto", width: int = 64) -> str:
    """The sparkline section for the table output.

    Args:
        mode: the mode to draw.
        units: units of the scale labels (see ``format_bytes``).
        width: columns of the sparkline.

    Returns:
        A header line, the sparkline, the phase letters and the peak caret, newline-joined.
    """
    timeline = mode.timeline
    picks = bucket_peaks(timeline, width)
    low, high = min(timeline), max(timeline)
    ops = mode.trace.ops
    letters = "".join(_letter(str(ops[i].phase), ops[i].iteration) for i in picks)
    # the peak's column: the first column whose pick is at or after the peak op
    column = next(c for c, i in enumerate(picks) if i >= mode.peak.step or c == len(picks) - 1)
    program = any(op.phase == "program" for op in ops)  # graphmem run: the program's own code too
    legend = ("p/f/l/b/o = program/forward/loss/backward/optimizer" if program
              else "f/l/b/o = forward/loss/backward/optimizer")
    header = (f"Live bytes over the {len(ops)} ops ({BLOCKS[0]} {format_bytes(low, units)}, "
              f"{BLOCKS[-1]} {format_bytes(high, units)}; {legend}, upper case = "
              f"{'step' if program else 'iteration'} 2)")
    caret = " " * column + f"^ peak {format_bytes(mode.peak_bytes, units)} at op {mode.peak.step}"
    return "\n".join([header, sparkline([timeline[i] for i in picks], low, high), letters, caret])


def _letter(phase: str, iteration: int) -> str:
    letter = PHASE_LETTERS.get(phase, "?")
    return letter.upper() if iteration % 2 else letter
