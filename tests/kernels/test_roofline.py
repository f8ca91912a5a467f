"""The roofline's calibration (measured once, cached per machine, measured again on demand or for
another machine) and its classification of an op against hand-computed values."""
from __future__ import annotations

import json
import time

import pytest

from kernels import roofline
from kernels.roofline import OpPoint, Roofline


@pytest.fixture
def quick(monkeypatch):
    """Small sizes: the test checks the mechanics, not this machine's peaks."""
    monkeypatch.setitem(roofline.MATMUL_SIZES, "cpu", (64, 128))
    monkeypatch.setitem(roofline.COPY_BYTES, "cpu", 4 << 20)
    monkeypatch.setattr(roofline, "BUDGET_S", 0.01)


def roof(peak_flops=100e9, peak_bw=20e9) -> Roofline:
    return Roofline(peak_flops, peak_bw, "cpu", "float32", {}, 0.0, 1024, 1 << 27)


def test_calibration_is_measured_once_then_cached_and_measured_again_on_demand(tmp_path, quick):
    progress: list[str] = []
    first, path, measured = roofline.calibrate(tmp_path, progress=progress.append)
    assert measured and path.is_file() and path.parent == tmp_path / "roofline"
    assert first.peak_flops > 1e6 and first.peak_bw > 1e6 and first.seconds < 3
    assert [m.split()[0] for m in progress] == ["matmul", "matmul", "copy"]
    assert json.loads(path.read_text())["fingerprint"] == roofline.fingerprint("cpu")

    again, path2, measured2 = roofline.calibrate(tmp_path)
    assert (again, path2, measured2) == (first, path, False)  # from the file, not measured

    redone, path3, measured3 = roofline.calibrate(tmp_path, recalibrate=True)
    assert measured3 and path3 == path and redone.seconds != first.seconds
    assert roofline.cached(tmp_path) == redone  # the cache holds the new figures


def test_a_calibration_from_another_machine_or_torch_is_not_trusted(tmp_path, quick, monkeypatch):
    roofline.calibrate(tmp_path)
    path = roofline.cache_path(tmp_path)
    d = json.loads(path.read_text())
    d["fingerprint"]["torch"] = "0.1"  # copied from a machine with another torch
    path.write_text(json.dumps(d))
    assert roofline.cached(tmp_path) is None
    _, _, measured = roofline.calibrate(tmp_path)
    assert measured
    monkeypatch.setattr(roofline, "cpu_model", lambda: "Another CPU")  # another machine: another file
    assert roofline.cache_path(tmp_path) != path and roofline.cached(tmp_path) is None


def test_calibration_at_its_real_sizes_reports_its_own_time(tmp_path):
    t = time.perf_counter()
    r, _, _ = roofline.calibrate(tmp_path)
    assert 0 < r.seconds <= time.perf_counter() - t and r.matmul_n in roofline.MATMUL_SIZES["cpu"]


def test_each_measurement_stops_at_its_budget_whatever_the_machine(monkeypatch):
    """Calibration's time is bounded by its budget, not by the machine's speed: a measurement runs
    REPEATS times (after one warm-up run) and then no more once BUDGET_S has passed. A clock that
    advances one second a reading stands for a machine far slower than any real one."""
    runs, now = [], iter(range(10**6))
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: float(next(now)))
    roofline._best(lambda: runs.append(1), lambda: None)
    assert len(runs) == 1 + roofline.REPEATS
    runs.clear()
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: 0.0)  # a clock that never moves: the cap
    roofline._best(lambda: runs.append(1), lambda: None)
    assert len(runs) == 1 + 1000


def test_classification_against_hand_values():
    r = roof(peak_flops=100e9, peak_bw=20e9)
    assert r.ridge == 5.0
    # a decode matmul: 1 token × 128 → 384 in float32: 2·1·128·384 FLOPs; weights 128·384, input 128,
    # output 384, bias 384, each 4 bytes
    flops, nbytes = 2 * 128 * 384, 4 * (128 * 384 + 128 + 384 + 384)
    p = OpPoint(flops, nbytes, duration_ns=20_000)
    assert p.intensity == pytest.approx(98304 / 200192)  # ≈ 0.49 FLOP/byte
    assert p.flops_per_s == pytest.approx(98304 / 20e-6) and p.bytes_per_s == pytest.approx(200192 / 20e-6)
    assert p.bound(r) == "memory"
    assert r.attainable(p.intensity) == pytest.approx(p.intensity * 20e9)
    assert p.efficiency(r) == pytest.approx((98304 / 20e-6) / (p.intensity * 20e9))
    # the same matmul over 256 prefill tokens: 2·256·128·384 FLOPs; input and output 256 rows
    flops, nbytes = 2 * 256 * 128 * 384, 4 * (128 * 384 + 256 * 128 + 256 * 384 + 384)
    q = OpPoint(flops, nbytes, duration_ns=1_000_000)
    assert q.intensity == pytest.approx(25165824 / 722432) and q.bound(r) == "compute"
    assert r.attainable(q.intensity) == 100e9
    assert OpPoint(10, 2, 1).bound(r) == "compute"  # exactly at the ridge: compute
    assert OpPoint(0, 0, 0).flops_per_s == 0.0
