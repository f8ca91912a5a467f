"""`vllm-trace roofline` (peaks, cache) and `vllm-trace export --roofline` (a recorded trace's profiled
steps as a self-contained HTML page or an SVG) on synthetic profiled traces."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from kernels import roofline
from tests.tui.profiled_events import ROOF, profiled_events
from tests.tui.tp_events import write_trace
from tracer.cli import main
from tracer.roofline_chart import BOTTOM, LEFT, RIGHT, TOP, H, W, export_roofline

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This machine's cached calibration is ROOF (ridge 5 FLOP/byte)."""
    monkeypatch.setenv("VLLM_TRACE_CACHE", str(tmp_path / "cache"))
    path = roofline.cache_path(tmp_path / "cache", "cpu", "float32")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**ROOF.to_dict(), "fingerprint": roofline.fingerprint("cpu", "float32")}))
    return path


def svg_of(text: str) -> ET.Element:
    return ET.fromstring(re.search(r"<svg.*</svg>", text, re.S).group(0))


def test_the_html_page_draws_prefill_and_decode_under_the_roofs(tmp_path, machine, capsys):
    trace = write_trace(tmp_path / "t.jsonl", profiled_events())
    out = tmp_path / "roofline.html"
    assert main(["export", str(trace), "--roofline", str(out)]) == 0
    assert "prefill (step 0) and decode (step 2)" in capsys.readouterr().err
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: nothing fetched
    svg = svg_of(page)
    circles = svg.findall(f"{SVG}circle")
    titles = [c.find(f"{SVG}title").text for c in circles if c.find(f"{SVG}title") is not None]
    # matmul, attention, norm, elementwise have FLOPs and bytes: a point each, for each step
    assert sorted(t.split(":")[0] for t in titles) == sorted(
        f"{s} {k}" for s in ("prefill", "decode") for k in ("matmul", "attention", "norm", "elementwise"))
    assert "prefill matmul: 14.5 FLOP/byte" in " ".join(titles) and "compute-bound" in next(
        t for t in titles if t.startswith("prefill matmul"))
    assert "memory-bound" in next(t for t in titles if t.startswith("decode matmul"))
    for c in circles:
        if c.find(f"{SVG}title") is not None:
            assert LEFT <= float(c.get("cx")) <= W - RIGHT and TOP <= float(c.get("cy")) <= H - BOTTOM
    assert svg.find(f"{SVG}path") is not None  # the roof
    assert "ridge 5 FLOP/byte" in page and "100 GFLOP/s" in page and "<table>" in page


def test_an_svg_of_one_step_and_clear_errors(tmp_path, machine, capsys):
    trace = write_trace(tmp_path / "t.jsonl", profiled_events())
    steps, roof = export_roofline(trace, tmp_path / "one.svg", step=1)
    assert [(s.label, s.step) for s in steps] == [("decode", 1)] and roof.ridge == ROOF.ridge == 5.0
    assert svg_of((tmp_path / "one.svg").read_text()).tag == f"{SVG}svg"
    assert main(["export", str(trace), "--roofline", str(tmp_path / "x.png")]) == 2
    assert "an .html page or an .svg image" in capsys.readouterr().err
    assert main(["export", str(trace), "--roofline", str(tmp_path / "x.html"), "--step", "3"]) == 2
    assert "step 3 of" in capsys.readouterr().err
    plain = write_trace(tmp_path / "plain.jsonl", profiled_events(profile=False))
    assert main(["export", str(plain), "--roofline", str(tmp_path / "x.html")]) == 2
    assert "no profiled steps" in capsys.readouterr().err
    assert main(["export", str(trace)]) == 2
    assert "-o OUT.json" in capsys.readouterr().err


def test_the_roofline_command_prints_the_cached_peaks_and_where_they_are(machine, capsys):
    assert main(["roofline"]) == 0
    out = capsys.readouterr().out
    assert "100 GFLOP/s" in out and "20 GB/s" in out and "ridge       5.0 FLOP/byte" in out
    assert str(machine) in out and "cached; --calibrate measures again" in out


def test_roofline_calibrate_measures_again(machine, capsys, monkeypatch):
    monkeypatch.setitem(roofline.MATMUL_SIZES, "cpu", (64,))
    monkeypatch.setitem(roofline.COPY_BYTES, "cpu", 1 << 20)
    assert main(["roofline", "--calibrate"]) == 0
    captured = capsys.readouterr()
    assert "measured now" in captured.out and "matmul 64×64" in captured.err
    assert roofline.cached(machine.parents[1]) != ROOF
