"""Stage 4: DOT graphs of the recorded step.  ModeReport -> networkx graph -> DOT (pydot).

Input: one ModeReport (training when analysed, else inference).
Output:
  - the op-level graph (``op_graph``): one node per recorded op, parameter, input and
    constant; labelled op, module, phase, shape, dtype and the bytes the op allocates,
    filled by size (log scale); data-flow edges (from the fx graph) solid, and
    saved-for-backward edges dashed, from the op (or parameter, input) that made a saved
    storage to each backward op that takes it; the storages live at the peak are
    highlighted (blue border, ``class="peak"``) and the peak op is a double octagon;
  - the module-level graph (``module_graph``): the same graph collapsed to the module tree
    cut at a depth, one node per module with its op count, parameter bytes, bytes
    allocated and its share of the live set at the peak (the per-module table's column).
DOT text needs pydot (``pip install graphmem[viz]``); rendering to SVG/PNG/PDF runs
Graphviz's ``dot`` program.  The fx graph is read, never annotated.
"""

from __future__ import annotations

import math
import operator
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from graphmem.errors import UserInputError
from graphmem.memory.results import ModeReport
from graphmem.records import Phase, Role, StorageRecord, Trace
from graphmem.report.formats import COLLAPSE_CHOICES, DOT_FORMATS, require_graphviz, require_pydot
from graphmem.report.modules import cut_module, module_rows, op_module, storage_module
from graphmem.report.series import live_at
from graphmem.units import format_bytes

if TYPE_CHECKING:  # networkx (0.1 s) is imported where a graph is built
    import networkx as nx
    import torch

__all__ = [
    "AUTO_COLLAPSE_NODES",
    "COLLAPSE_CHOICES",
    "DOT_FORMATS",
    "PALETTE",
    "build_graph",
    "module_graph",
    "op_bytes",
    "op_graph",
    "render_graphviz",
    "require_pydot",
    "to_dot",
    "write_dot",
]

AUTO_COLLAPSE_NODES = 300  # past this many op-level nodes, "auto" collapses to modules
# ColorBrewer YlOrRd, 9 classes (colorbrewer2.org): light = few bytes, dark = many
PALETTE = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c", "#bd0026", "#800026")
PEAK_COLOUR = "#1f4eb4"
_GRAPH_ATTRS = {"graph": {"rankdir": "TB", "fontname": "Helvetica", "fontsize": "12", "labelloc": "t"},
                "node": {"shape": "box", "style": "rounded,filled", "fontname": "Helvetica", "fontsize": "10"},
                "edge": {"color": "#555555", "arrowsize": "0.6"}}


def _log_range(sizes: Iterable[int]) -> tuple[float, float]:
    """The log of the smallest and largest non-zero of ``sizes`` (0, 0 when none)."""
    nonzero = [n for n in sizes if n > 0]
    return (math.log(min(nonzero)), math.log(max(nonzero))) if nonzero else (0.0, 0.0)


def _fill(nbytes: int, log_range: tuple[float, float]) -> dict[str, str]:
    """Fill and font colour for ``nbytes`` on a log scale from the smallest non-zero size
    (lightest) to the largest (darkest); white for zero bytes."""
    if nbytes <= 0:
        return {"fillcolor": "#ffffff"}
    low, high = log_range
    share = (math.log(nbytes) - low) / (high - low) if high > low else 1.0
    level = max(0, min(len(PALETTE) - 1, round((len(PALETTE) - 1) * share)))
    return {"fillcolor": PALETTE[level], "fontcolor": "white" if level >= 6 else "black"}


def _short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _describe(storage: StorageRecord | None) -> str:
    if storage is None:
        return ""
    return f"{storage.dtype}[{', '.join(map(str, storage.shape))}]"


def _placeholder_storages(trace: Trace) -> dict[str, StorageRecord]:
    """Graph node id of each placeholder -> its storage.  The recorder asks fx for a
    placeholder named after the storage's label (dots and spaces as "_"): the node's
    target; its name may carry a suffix fx added to keep names unique."""
    by_label = {s.label.replace(".", "_").replace(" ", "_"): s for s in trace.storages if s.created < 0 and s.label}
    return {f"in_{node.name}": by_label[str(node.target)] for node in trace.graph.nodes
            if node.op == "placeholder" and str(node.target) in by_label}


def _node_ids(trace: Trace) -> dict[torch.fx.Node, str]:
    """fx node -> graph node id; a getitem shares the id of the op whose output it picks."""
    ids: dict[torch.fx.Node, str] = {}
    for node in trace.graph.nodes:
        if node.op == "placeholder":
            ids[node] = f"in_{node.name}"
        elif node.op == "get_attr":
            ids[node] = f"const_{node.name}"
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in ids:
            ids[node] = ids[node.args[0]]
        elif node.op == "call_function" and "graphmem" in node.meta:
            ids[node] = f"op{node.meta['graphmem']['op_index']}"
    return ids


def _producers(trace: Trace) -> dict[int, str]:
    """Storage id -> the node that made it: its creating op, or its placeholder."""
    made = {s.sid: f"op{s.created}" for s in trace.storages if s.created >= 0}
    for node_id, storage in _placeholder_storages(trace).items():
        made[storage.sid] = node_id
    return made


def _made(mode: ModeReport) -> dict[int, list[StorageRecord]]:
    """Op index -> the storages it allocated (outputs first seen at that op; not views)."""
    storages = {s.sid: s for s in mode.trace.storages}
    return {op.index: [storages[sid] for sid in op.outputs if storages[sid].created == op.index]
            for op in mode.trace.ops}


def op_bytes(mode: ModeReport) -> dict[int, int]:
    """Op index -> bytes it allocates: its new output storages plus its scratch bytes."""
    made = _made(mode)
    return {op.index: sum(s.nbytes for s in made[op.index]) + op.scratch_bytes for op in mode.trace.ops}


def _op_nodes(graph: nx.DiGraph, mode: ModeReport, units: str) -> None:
    trace = mode.trace
    storages = {s.sid: s for s in trace.storages}
    made, sizes = _made(mode), op_bytes(mode)
    scale = _log_range([*sizes.values(), *(s.nbytes for s in storages.values() if s.created < 0)])
    for op in trace.ops:
        shown = made[op.index][0] if made[op.index] else (storages[op.outputs[0]] if op.outputs else None)
        # a view or an in-place op: it shows the storage it shares, not its own shape
        what = _describe(shown) if made[op.index] or shown is None else f"shares {_describe(shown)}"
        label = (f"#{op.index} {_short(op.op)}\\n{op_module(trace, op.index)} · {op.phase} {op.iteration + 1}"
                 f"\\n{what}\\n{format_bytes(sizes[op.index], units)}")
        graph.add_node(f"op{op.index}", label=label, tooltip=op.op, **_fill(sizes[op.index], scale))
    for node_id, s in _placeholder_storages(trace).items():
        graph.add_node(node_id, shape="box", style="filled", label=(
            f"{s.label}\\n{_describe(s)}\\n{format_bytes(s.nbytes, units)}"), **_fill(s.nbytes, scale))


def _edges(trace: Trace, ids: dict[torch.fx.Node, str]) -> list[tuple[str, str, str]]:
    """(from, to, kind) with kind "data" (fx graph args) or "saved" (saved for backward)."""
    edges = {}
    for node in trace.graph.nodes:
        if "graphmem" not in node.meta or node not in ids:
            continue
        for source in node.all_input_nodes:
            if source in ids and ids[source] != ids[node]:
                edges[(ids[source], ids[node])] = "data"
    made = _producers(trace)
    saved = {s.sid for s in trace.storages if Role.SAVED in s.roles}
    # a saved storage goes to every backward op that reads it (by storage, so views count)
    for op in trace.ops:
        if op.phase == Phase.BACKWARD:
            for sid in saved.intersection(op.inputs):
                if sid in made and made[sid] != f"op{op.index}":
                    edges[(made[sid], f"op{op.index}")] = "saved"
    return [(u, v, kind) for (u, v), kind in edges.items()]


def op_graph(mode: ModeReport, units: str = "auto") -> nx.DiGraph:
    """The op-level graph (see the module docstring); node ids ``op{i}``, ``in_{name}``,
    ``const_{name}``; edges carry ``kind`` "data" or "saved"."""
    import networkx as nx

    trace = mode.trace
    graph = nx.DiGraph(**_GRAPH_ATTRS)
    _op_nodes(graph, mode, units)
    ids = _node_ids(trace)
    for node, node_id in ids.items():
        if node.op == "get_attr" or (node.op == "placeholder" and node_id not in graph):
            graph.add_node(node_id, label=node.name, shape="box", style="filled", fillcolor="#eeeeee")
    for u, v, kind in _edges(trace, ids):
        style = {"style": "dashed", "color": "#8a8a8a"} if kind == "saved" else {}
        graph.add_edge(u, v, kind=kind, **style)
    _mark_peak(graph, mode)
    graph.graph["legend"] = ("fill: bytes the op allocates (log scale); blue border: made a storage live at the "
                             "peak; double octagon: the peak op; solid: data flow; dashed: saved for backward")
    return graph


def _mark_peak(graph: nx.DiGraph, mode: ModeReport) -> None:
    """Blue border and ``class="peak"`` on the makers of the storages live at the peak."""
    made = _producers(mode.trace)
    for life in live_at(mode, mode.peak.step):
        node = made.get(life.sid)
        if node in graph:
            graph.nodes[node].update({"class": "peak", "color": PEAK_COLOUR, "penwidth": "2.5"})
    peak = graph.nodes[f"op{mode.peak.step}"]
    peak.update({"shape": "doubleoctagon", "class": "peak peak_op", "color": PEAK_COLOUR, "penwidth": "3"})
    peak["label"] = "PEAK " + format_bytes(mode.peak_bytes) + "\\n" + peak["label"]


def _groups(graph: nx.DiGraph, mode: ModeReport, depth: int) -> dict[str, str]:
    """Op-level node id -> its module cut at ``depth``; a constant joins its first reader."""
    trace = mode.trace
    group = {f"op{op.index}": cut_module(op_module(trace, op.index), depth) for op in trace.ops}
    categories = {life.sid: life.category for life in mode.lifetimes}
    for node_id, s in _placeholder_storages(trace).items():
        group[node_id] = cut_module(storage_module(s, categories[s.sid], trace), depth)
    for node in graph:
        if node not in group:
            readers = sorted(graph.successors(node), key=lambda n: int(n[2:]) if n.startswith("op") else 0)
            group[node] = group.get(readers[0], "(root)") if readers else "(root)"
    return group


def module_graph(mode: ModeReport, depth: int = 2, units: str = "auto") -> nx.MultiDiGraph:
    """The op graph collapsed to modules cut at ``depth``: one node per module (its ops,
    parameter bytes, bytes its ops allocate, its bytes at the peak as in the per-module
    table), one edge per (from module, to module, kind), solid for data, dashed for saved."""
    import networkx as nx

    ops = op_graph(mode, units)
    group = _groups(ops, mode, depth)
    rows = {r.module: r for r in module_rows(mode, depth)}
    counts: dict[str, int] = {}
    allocated: dict[str, int] = {}
    for index, nbytes in op_bytes(mode).items():
        key = group[f"op{index}"]
        counts[key] = counts.get(key, 0) + 1
        allocated[key] = allocated.get(key, 0) + nbytes
    graph = nx.MultiDiGraph(**_GRAPH_ATTRS)
    scale = _log_range(r.peak_bytes for r in rows.values())
    for key in dict.fromkeys(group.values()):
        params, at_peak = (rows[key].params_bytes, rows[key].peak_bytes) if key in rows else (0, 0)
        label = (f"{key}\\n{counts.get(key, 0)} ops\\nparameters {format_bytes(params, units)}"
                 f"\\nallocated {format_bytes(allocated.get(key, 0), units)}\\nat peak {format_bytes(at_peak, units)}")
        graph.add_node(key, label=label, **_fill(at_peak, scale), **({"class": "peak"} if at_peak else {}))
    graph.nodes[group[f"op{mode.peak.step}"]].update(
        {"shape": "doubleoctagon", "class": "peak peak_op", "color": PEAK_COLOUR, "penwidth": "3"})
    _collapse_edges(graph, ops, group)
    graph.graph["legend"] = ("fill: the module's bytes live at the peak (log scale); double octagon: the module "
                             "of the peak op; solid: data flow; dashed: saved for backward")
    return graph


def _collapse_edges(graph: nx.MultiDiGraph, ops: nx.DiGraph, group: dict[str, str]) -> None:
    """One edge per (module, module, kind), thicker the more op edges it stands for."""
    counts: dict[tuple[str, str, str], int] = {}
    for u, v, kind in ops.edges(data="kind"):
        if group[u] != group[v]:
            counts[(group[u], group[v], kind)] = counts.get((group[u], group[v], kind), 0) + 1
    for (u, v, kind), n in counts.items():
        style = {"style": "dashed", "color": "#8a8a8a"} if kind == "saved" else {}
        graph.add_edge(u, v, key=kind, kind=kind, weight=n, tooltip=f"{n} {kind} edges",
                       penwidth=f"{min(4.0, 1 + math.log10(n)):.2f}", **style)


def build_graph(mode: ModeReport, collapse: str = "auto", depth: int = 2, units: str = "auto") -> nx.DiGraph:
    """The graph ``collapse`` asks for: ``op``, ``module``, or ``auto`` (module past
    ``AUTO_COLLAPSE_NODES`` op-level nodes)."""
    if collapse not in COLLAPSE_CHOICES:
        raise UserInputError(f"unknown --collapse {collapse!r}; expected one of: {', '.join(COLLAPSE_CHOICES)}")
    if collapse == "op" or (collapse == "auto" and _op_level_size(mode) <= AUTO_COLLAPSE_NODES):
        return op_graph(mode, units)
    return module_graph(mode, depth, units)


def _op_level_size(mode: ModeReport) -> int:
    return len(mode.trace.ops) + sum(1 for n in mode.trace.graph.nodes if n.op in ("placeholder", "get_attr"))


def to_dot(graph: nx.DiGraph, title: str = "") -> str:
    """DOT text of ``graph`` (via pydot, which networkx needs to write DOT)."""
    require_pydot()
    from networkx.drawing.nx_pydot import to_pydot

    dot = to_pydot(graph)
    legend = str(graph.graph.get("legend", ""))
    dot.set_label(f"{title}\\n{legend}" if title else legend)
    return str(dot.to_string())


def render_graphviz(dot_text: str, fmt: str) -> bytes:
    """Run Graphviz's ``dot -T{fmt}`` on ``dot_text``; UserInputError when it is missing."""
    program = require_graphviz(fmt)
    done = subprocess.run([program, f"-T{fmt}"], input=dot_text.encode("utf-8"), capture_output=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"render_graphviz: dot -T{fmt} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout


def write_dot(mode: ModeReport, path: str | Path, *, collapse: str = "auto", depth: int = 2,
              units: str = "auto", title: str = "") -> nx.DiGraph:
    """Write the graph to ``path``: DOT text for .dot/.gv, rendered by Graphviz for
    .svg/.png/.pdf.  Returns the graph written."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in DOT_FORMATS:
        raise UserInputError(f"unknown --dot file type {Path(path).suffix!r}; expected one of: "
                             + ", ".join(f".{f}" for f in DOT_FORMATS))
    graph = build_graph(mode, collapse, depth, units)
    text = to_dot(graph, title)
    Path(path).write_bytes(text.encode("utf-8") if fmt in ("dot", "gv") else render_graphviz(text, fmt))
    return graph
