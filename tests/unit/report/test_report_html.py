"""The --html page: well-formed, self-contained, escaped; the numbers it shows; what a browser draws."""

from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

import graphmem
from graphmem.cli import main
from graphmem.memory.results import MemoryReport
from graphmem.preflight.budget import Budget
from graphmem.report.html import MAX_POINTS, decimate, render_html
from tests.conftest import ROOT

MLP = f"{ROOT}/examples/mlp.py:MLP"
_VOID = {"meta", "br", "hr", "img", "input", "link", "wbr"}
_BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def mlp() -> MemoryReport:
    return graphmem.analyze(MLP, ["8x1000"], optimizer="adam")


class _Page(HTMLParser):
    """Checks that every element is closed in order; keeps the tags, the text, the table rows
    (cell texts) and the attributes of the SVG shapes."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: Counter[str] = Counter()
        self.text: list[str] = []
        self.rows: list[list[str]] = []
        self.shapes: list[tuple[str, dict[str, str]]] = []
        self.doctype = ""
        self.feed(text)
        self.close()
        assert not self.stack, f"elements left open: {self.stack}"

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._shape(tag, attrs)
        if tag not in _VOID:
            self.stack.append(tag)
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self.rows[-1].append("")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._shape(tag, attrs)

    def _shape(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.shapes.append((tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self.stack and self.stack[-1] in ("td", "th"):
            self.rows[-1][-1] += data

    def row(self, first: str, nth: int = -1) -> list[str]:
        """The ``nth`` table row whose first cell is ``first`` (the last by default)."""
        return [r for r in self.rows if r and r[0] == first][nth]


def test_page_is_well_formed_and_self_contained(mlp: MemoryReport) -> None:
    page = render_html(mlp)
    parsed = _Page(page)
    assert parsed.doctype.lower() == "doctype html"
    assert parsed.tags["svg"] >= 3 and parsed.tags["polyline"] == 2 and parsed.tags["table"] >= 4
    lowered = page.lower()
    for outside in ("http://", "https://", "src=", "href=", "<script", "<link", "url(", "@import", "<iframe"):
        assert outside not in lowered, outside


def test_page_states_the_peaks_facts_and_module_rows(mlp: MemoryReport) -> None:
    assert mlp.train is not None and mlp.inference is not None
    parsed = _Page(render_html(mlp, units="B"))
    text = " ".join(parsed.text)
    assert parsed.row("model", 0)[1] == MLP  # the facts come first
    assert parsed.row("optimizer", 0)[1].startswith("adam")
    assert "550,600 float32" in parsed.row("parameters", 0)[1]  # 1000*500+500 + 500*100+100
    assert parsed.row("peak (live tensor bytes)")[1:] == [f"{mlp.inference.peak_bytes:,} B",
                                                          f"{mlp.train.peak_bytes:,} B"]
    assert f"peak {mlp.train.peak_bytes:,} B after op {mlp.train.peak.step}" in text
    # per module (training, depth 2): parameters and gradients by module; the optimizer state
    # (Adam's two moments and a 4-byte step per parameter) in the optimizer step's row
    # layers.0: 1000*500 + 500 = 500,500 float32 -> 2,002,000 B; layers.2: 500*100 + 100 -> 200,400 B
    assert parsed.row("layers.0")[1:4] == ["2,002,000 B", "2,002,000 B", "0 B"]
    assert parsed.row("layers.2")[1:4] == ["200,400 B", "200,400 B", "0 B"]
    assert parsed.row("(optimizer step)")[1:4] == ["0 B", "0 B", f"{2 * (2_002_000 + 200_400) + 4 * 4:,} B"]
    assert parsed.row("(inputs)")[-2] == "0.2%"  # 8x1000 float32 = 32,000 B of the peak
    assert parsed.row("total")[1] == "2,202,400 B"  # the per-module table's total: 550,600 float32


def test_timeline_points_reach_the_peak_marker(mlp: MemoryReport) -> None:
    assert mlp.train is not None
    parsed = _Page(render_html(mlp))
    lines = [attrs["points"].split() for tag, attrs in parsed.shapes if tag == "polyline"]
    assert [len(points) for points in lines] == [mlp.inference.num_ops if mlp.inference else 0, mlp.train.num_ops]
    markers = [float(attrs["cy"]) for tag, attrs in parsed.shapes if tag == "circle"]
    # the peak marker sits on the highest point of each line (SVG y grows downwards)
    assert markers == [min(float(p.split(",")[1]) for p in points) for points in lines]


def test_long_timeline_is_thinned_and_keeps_its_peak(mlp: MemoryReport) -> None:
    train = mlp.train
    assert train is not None and max(train.timeline) == train.peak_bytes
    long = replace(train, timeline=tuple(train.timeline) * 40)  # 5,760 ops
    page = render_html(replace(mlp, inference=None, train=long))
    points = next(attrs["points"].split() for tag, attrs in _Page(page).shapes if tag == "polyline")
    assert len(points) <= MAX_POINTS < len(long.timeline)
    cy = next(float(attrs["cy"]) for tag, attrs in _Page(page).shapes if tag == "circle")
    assert min(float(p.split(",")[1]) for p in points) == cy


def test_decimate_keeps_the_maximum() -> None:
    rng = random.Random(12)
    for n, limit in ((100_000, 500), (5_001, 5_000), (3_000, 3), (7, 10)):
        values = [rng.randrange(1_000) for _ in range(n)]
        spike = rng.randrange(n)
        values[spike] = 10**9
        kept = decimate(values, limit)
        assert len(kept) <= limit and list(kept) == sorted(set(kept))
        assert spike in kept and kept[0] == 0 and kept[-1] == n - 1
    assert decimate([5, 1, 9], 10) == (0, 1, 2)


def test_text_is_escaped(make_module: Callable[[str], str]) -> None:
    name = make_module("""
        import torch
        from torch import nn

        class Tricky(nn.Module):
            def __init__(self):
                super().__init__()
                self.add_module("<b>x</b>&", nn.Linear(4, 4))

            def forward(self, x):
                return getattr(self, "<b>x</b>&")(x)
    """)
    page = render_html(graphmem.analyze(f"{name}:Tricky", ["2x4"]))
    assert "<b>" not in page and "&lt;b&gt;x&lt;/b&gt;&amp;" in page
    assert any(row[0] == "<b>x</b>&" for row in _Page(page).rows)


def test_parallel_page_has_the_per_gpu_table() -> None:
    report = graphmem.analyze(f"{ROOT}/tests/models.py:MLP", ["8x1000"], mode="train", optimizer="adam",
                              parallel="zero1=4")
    parsed = _Page(render_html(report))
    assert "Per GPU, train (adam) with zero1=4 (4 ranks)" in " ".join(parsed.text)
    head = next(r for r in parsed.rows if r[:2] == ["ranks", "peak"])
    assert head[-1] == "communication"
    assert report.train is not None
    assert sorted(r[0] for r in parsed.rows if r[0] in "0123" and r[0]) == ["0", "1", "2", "3"]


def test_cli_writes_the_page_whole(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "8x1000", "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no partial file left
    assert "layers.0" in page.read_text(encoding="utf-8")


@pytest.mark.parametrize("path, fragment", [("report.txt", "expected a file ending in .html, .htm"),
                                            ("missing/report.html", "does not exist")])
def test_cli_refuses_a_bad_page_path_before_analysing(tmp_path: Path, path: str, fragment: str) -> None:
    result = CliRunner().invoke(main, ["analyze", "nowhere.py:Nothing", "--input", "8x1000",
                                       "--html", str(tmp_path / path)])
    assert result.exit_code == 2 and fragment in result.output
    assert not list(tmp_path.iterdir())


def test_cli_refuses_the_page_and_the_output_in_one_file(tmp_path: Path) -> None:
    same = str(tmp_path / "a.html")
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "8x1000", "--html", same, "--output", same])
    assert result.exit_code == 2 and "--output and --html name the same file" in result.output


# --- the verdict and the budget line -------------------------------------------------------------

H100_BYTES = 85_027_979_264  # the h100-80gb preset's total_memory (torch.cuda.get_device_properties)


def _lines(page: str, css: str) -> list[float]:
    """The y of each horizontal line drawn in a group of class ``css`` (SVG y grows downwards)."""
    parsed = _Page(page)
    out, inside = [], False
    for tag, attrs in parsed.shapes:
        if tag == "g":
            inside = attrs.get("class") == css
        elif tag == "line" and inside:
            out.append(float(attrs["y1"]))
    return out


def test_page_with_a_gpu_says_whether_it_fits(tmp_path: Path) -> None:
    page_path = tmp_path / "page.html"
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "8x1000", "--mode", "train", "--gpu", "h100-80gb",
                                       "--units", "B", "--format", "json", "--html", str(page_path)])
    assert result.exit_code == 0, result.output
    train = json.loads(result.output)["train"]
    on_gpu = train["reserved_peak_bytes"] + 500 * 2**20  # the reserved peak + h100-80gb's 500 MiB CUDA context
    assert on_gpu == train["nvidia_smi_estimate_bytes"]
    page = page_path.read_text(encoding="utf-8")
    parsed = _Page(page)
    assert "Will it fit?" in parsed.text
    # what graphmem check compares on a GPU: the reserved peak plus the CUDA context, against its memory
    assert parsed.row("on the GPU (reserved peak + CUDA context)")[1:] == [f"{on_gpu:,} B"]
    assert parsed.row("budget (h100-80gb memory)")[1:] == [f"{H100_BYTES:,} B"]
    room = H100_BYTES - on_gpu
    assert parsed.row("verdict")[1:] == [f"FITS: {room:,} B headroom ({room / H100_BYTES:.1%} of the budget)"]
    # the GPU holds thousands of times this peak: named under the chart, not drawn; the dotted
    # line is what the GPU holds at the peak
    assert f"The budget (h100-80gb memory) is {H100_BYTES:,} B" in page and not _lines(page, "budget")
    assert len(_lines(page, "on-gpu")) == 1


@pytest.mark.parametrize("tenths", [1, -1])
def test_budget_line_and_verdict(mlp: MemoryReport, tenths: int) -> None:
    assert mlp.train is not None and mlp.inference is not None
    peak = mlp.train.peak_bytes
    spare = tenths * peak // 10  # a budget 10% above or below the peak
    verdict = f"FITS: {spare:,} B headroom" if spare > 0 else f"DOES NOT FIT: short by {-spare:,} B"
    page = render_html(replace(mlp, inference=None), units="B", budget=Budget(peak + spare, Fraction(0), "a budget"))
    parsed = _Page(page)
    assert parsed.row("peak (live tensor bytes)", 0)[1:] == [f"{peak:,} B"]  # CPU: the tensor bytes at the peak
    assert parsed.row("verdict")[1].startswith(verdict + " (")
    (line,) = _lines(page, "budget")  # within twice the peak: drawn
    marker = next(float(attrs["cy"]) for tag, attrs in parsed.shapes if tag == "circle")
    assert (line < marker) == (spare > 0)  # above the peak when it fits, below when it does not
    assert f"budget {peak + spare:,} B (a budget)" in " ".join(parsed.text)


def test_no_gpu_and_no_budget_no_verdict(mlp: MemoryReport) -> None:
    page = render_html(mlp)
    assert "Will it fit?" not in page and not _lines(page, "budget")


# --- in a browser -------------------------------------------------------------------------------

def _png_pixels(data: bytes) -> tuple[int, int, Counter[tuple[int, int, int]]]:
    """Width, height and a count of each RGB colour of an 8-bit RGB/RGBA PNG (not interlaced):
    the chunks, zlib and the five row filters of the PNG specification, section 9."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pos, idat, header = 8, [], (0, 0, 0, 0, 0, 0, 0)
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data[pos + 8:pos + 8 + length])
        elif kind == b"IDAT":
            idat.append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and not interlace, f"unsupported PNG {header}"
    bpp = 3 if colour == 2 else 4
    stride, raw = width * bpp, zlib.decompress(b"".join(idat))
    prev, colours = bytearray(stride), Counter[tuple[int, int, int]]()
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 2:  # Up, the common one: done row-wide
            line = bytearray((x + b) & 255 for x, b in zip(line, prev, strict=True))
        elif kind:
            _unfilter(kind, line, prev, bpp)
        colours.update(zip(line[0::bpp], line[1::bpp], line[2::bpp], strict=True))
        prev = line
    return width, height, colours


def _unfilter(kind: int, line: bytearray, prev: bytearray, bpp: int) -> None:
    """Undo filter Sub (1), Average (3) or Paeth (4) in place, byte by byte."""
    for i in range(len(line)):
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
        if kind == 3:
            a = (a + b) // 2
        elif kind == 4:
            p = a + b - c
            a = a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c) else b if abs(p - b) <= abs(p - c) else c
        line[i] = (line[i] + a) & 255


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


def test_chromium_draws_the_page(mlp: MemoryReport, tmp_path: Path) -> None:
    browser = next((b for b in map(shutil.which, _BROWSERS) if b), None)
    if browser is None:
        pytest.skip(f"no headless browser to render the page: none of {', '.join(_BROWSERS)} is on PATH "
                    "(apt-get install chromium)")
    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(render_html(mlp), encoding="utf-8")
    subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,1800",
                    page.as_uri()], check=True, capture_output=True, timeout=180)
    width, height, colours = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1800)
    white = colours[(255, 255, 255)]
    assert white < 0.9 * width * height, "the screenshot is (almost) blank"
    # what the page draws, by the colours it fills large areas with (pixels of each colour)
    drawn = {"forward band": "#e3eefa", "backward band": "#fdeadb", "optimizer band": "#e6f4e1",
             "parameters bar": "#4c72b0", "optimizer state bar": "#55a868", "temporaries bar": "#8c8c8c"}
    for what, colour in drawn.items():
        assert colours[_rgb(colour)] > 500, f"{what} ({colour}) not drawn: {colours[_rgb(colour)]} pixels"
    assert colours[_rgb("#b00020")] >= 20, "the peak marker is not drawn"
    assert sum(n for rgb, n in colours.items() if max(rgb) < 90) > 2000, "no text drawn"
