"""numbaengine.profile on the CPU: phases written by span() across processes, the per-phase summary (energy,
J/token, shading intervals, verdicts) on synthetic samples, and the command line around a child with a fake NVML."""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from numbaengine import phases
from numbaengine.profile import (
    OTHER,
    Sample,
    main,
    phases_at,
    read_phases,
    segments,
    summarize,
    token_counts,
    tokens_from_output,
    verdict,
    write_outputs,
)

REPO = Path(__file__).resolve().parents[1]
WALL0 = 1000.0
SPANS = [dict(phase="load", start=1001.0, end=1005.0, pid=1), dict(phase="compile", start=1002.0, end=1003.0, pid=1),
         dict(phase="decode", start=1006.0, end=1008.0, pid=1), dict(phase="decode", time=1008.0, pid=1, tokens=100)]


class FakeNVML:
    """pynvml stand-in: one GPU drawing a constant 250 W (the energy counter follows the clock), GPM supported."""
    NVMLError = RuntimeError
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1
    NVML_GPM_METRICS_GET_VERSION, NVML_GPM_METRIC_DRAM_BW_UTIL, NVML_GPM_METRIC_SM_UTIL = 1, 10, 11
    WATTS = 250.0

    def nvmlInit(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return 700_000
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return int(self.WATTS * time.perf_counter() * 1000)   # mJ
    def nvmlDeviceGetPowerUsage(self, h): return int(self.WATTS * 1000)
    def nvmlDeviceGetClockInfo(self, h, which): return (1980, 3201)[which]
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=100, memory=60)
    def nvmlGpmQueryDeviceSupport(self, h): return SimpleNamespace(isSupportedDevice=1)
    def nvmlGpmSampleAlloc(self): return object()
    def nvmlGpmSampleGet(self, h, s): pass
    def nvmlGpmSampleFree(self, s): pass
    def c_nvmlGpmMetricsGet_t(self): return SimpleNamespace(metrics=[SimpleNamespace(), SimpleNamespace()])
    def nvmlGpmMetricsGet(self, m): m.metrics[0].value, m.metrics[1].value = 70.0, 90.0


def synthetic(decode=(6.0, 8.0), seconds=10.0):
    """Samples every 0.1 s: 100 W, 5% DRAM, 10% busy, except 500 W, 80% DRAM, 100% busy inside `decode`."""
    lo, hi = decode

    def energy(t):
        return 100 * t + 400 * max(0.0, min(t, hi) - lo)
    out = []
    for i in range(1, round(seconds * 10)):
        t = round(0.1 * i, 4)
        hot = lo <= t - 0.05 < hi
        out.append(Sample(t, 0, 500.0 if hot else 100.0, 1980, 3201, 100 if hot else 10, 50, 80.0 if hot else 5.0,
                          90.0 if hot else 10.0, energy(t)))
    return out, [energy(seconds)]


def rows_by_phase(rows):
    return {r["phase"]: r for r in rows}


def test_span_lines_from_several_processes(tmp_path, monkeypatch):
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv("NUMBAENGINE_PHASES", str(path))
    code = "from numbaengine.phases import span\nfor _ in range(40):\n    with span('decode'):\n        pass"
    children = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for _ in range(2)]
    with phases.span("load"), phases.span("compile"):
        pass
    phases.record("decode", tokens=7)
    assert all(c.wait(timeout=300) == 0 for c in children)
    lines = read_phases(path)
    assert len(lines) == 83 and len(path.read_text().splitlines()) == 83       # every line whole
    assert len({r["pid"] for r in lines}) == 3
    assert all(r["end"] >= r["start"] for r in lines if "start" in r)
    assert {"phase": "decode", "tokens": 7}.items() <= next(r for r in lines if "tokens" in r).items()


def test_segments_innermost_wins_and_the_rest_is_other():
    segs = segments(SPANS, WALL0, 10.0)
    assert segs == [(OTHER, 0.0, 1.0), ("load", 1.0, 2.0), ("compile", 2.0, 3.0), ("load", 3.0, 5.0),
                    (OTHER, 5.0, 6.0), ("decode", 6.0, 8.0), (OTHER, 8.0, 10.0)]
    assert phases_at(segs, [-1.0, 0.5, 2.5, 4.0, 7.99, 9.0, 11.0]) == \
        [OTHER, OTHER, "compile", "load", "decode", OTHER, OTHER]
    assert segments([dict(phase="decode", start=995.0, end=1002.0)], WALL0, 4.0) == \
        [("decode", 0.0, 2.0), (OTHER, 2.0, 4.0)]                                 # clipped to the profile


def test_per_phase_energy_power_and_j_per_token():
    samples, energy = synthetic()
    segs = segments(SPANS, WALL0, 10.0)
    rows = rows_by_phase(summarize(samples, energy, 10.0, [700.0], segs, 0.1, token_counts(SPANS, None, "")))
    dec, load, every = rows["decode"], rows["load"], rows["all"]
    assert dec["energy_j"] == pytest.approx(1000.0, rel=1e-3) and dec["power_w"] == pytest.approx(500.0, rel=1e-3)
    assert dec["tokens"] == 100 and dec["j_per_token"] == pytest.approx(10.0, rel=1e-3)
    assert dec["dram_bw_pct"] == pytest.approx(80.0) and dec["verdict"].startswith("memory-bound")
    assert load["seconds"] == pytest.approx(3.0) and load["spans"] == 2 and load["power_w"] == pytest.approx(100.0)
    assert load["j_per_token"] is None and load["verdict"].startswith("mostly idle")
    assert rows[OTHER]["seconds"] == pytest.approx(4.0)
    assert every["energy_j"] == pytest.approx(1800.0) and every["j_per_token"] == pytest.approx(18.0)
    text = verdict(list(rows.values()))
    assert "decode" in text and "500 W of 700 W (71%)" in text and "10.0 J/token" in text


def test_short_phase_gets_no_verdict():
    samples, energy = synthetic(decode=(6.0, 6.15))
    spans = [dict(phase="decode", start=1006.0, end=1006.15)]
    rows = rows_by_phase(summarize(samples, energy, 10.0, [700.0], segments(spans, WALL0, 10.0), 0.1))
    assert rows["decode"]["verdict"] == "too short to sample (150 ms): hold it longer (--hold-seconds)"
    assert rows["all"]["verdict"].startswith("mostly idle")


@pytest.mark.parametrize("dram,util,expect", [(82.0, 100, "memory-bound"), (3.0, 96, "busy but not memory-bound"),
                                              (2.0, 10, "mostly idle"), (float("nan"), 10, "mostly idle")])
def test_verdict_reads_the_signature(dram, util, expect):
    samples = [Sample(0.1 * i, 0, 205.0, 1980, 3201, util, 50, dram, 90.0, 20.5 * i) for i in range(1, 11)]
    segs = [("decode", 0.0, 1.0)]
    rows = summarize(samples, [20.5 * 10], 1.0, [700.0], segs, 0.1, {"decode": 50})
    assert rows_by_phase(rows)["decode"]["verdict"].startswith(expect)
    assert "205 W of 700 W (29%)" in verdict(rows)


def test_token_counts():
    assert token_counts(SPANS, None, '{"new_tokens": 9}') == {"decode": 100}       # recorded beats printed
    assert token_counts(SPANS[:3], None, '{"new_tokens": 9}') == {"decode": 9}
    assert token_counts([], 12, "") == {"all": 12}
    assert token_counts([], None, "no json") == {}
    assert tokens_from_output('progress\n{"tokens": [1, 2, 3], "text": "x"}\n') == 3
    assert tokens_from_output("no json here") is None


def test_outputs_written(tmp_path):
    samples, energy = synthetic()
    segs = segments(SPANS, WALL0, 10.0)
    rows = summarize(samples, energy, 10.0, [700.0], segs, 0.1)
    write_outputs(tmp_path, samples, segs, rows, 0.1)
    csv_lines = (tmp_path / "nvml.csv").read_text().splitlines()
    assert len(csv_lines) == len(samples) + 1 and csv_lines[0].endswith(",phase") and csv_lines[70].endswith("decode")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert ["decode", 6.0, 8.0] in summary["segments"]
    assert {r["phase"] for r in summary["rows"]} == {"all", OTHER, "load", "compile", "decode"}
    assert "GPU 0 decode" in (tmp_path / "verdict.txt").read_text()
    assert (tmp_path / "nvml.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_command_line_names_the_child_phases(tmp_path, capsys):
    child = ("import time\nfrom numbaengine.phases import record, span\n"
             "with span('load'):\n    time.sleep(0.5)\n"
             "with span('decode'):\n    time.sleep(0.6)\n"
             "record('decode', tokens=30)\nprint('{\"new_tokens\": 999}')")
    rc = main(["--out", str(tmp_path), "--", sys.executable, "-c", child], nvml=FakeNVML())
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = rows_by_phase(summary["rows"])
    assert {"load", "decode", "all"} <= set(rows)
    dec = rows["decode"]
    assert dec["tokens"] == 30 and dec["power_w"] == pytest.approx(FakeNVML.WATTS, rel=0.02)
    assert dec["j_per_token"] == pytest.approx(FakeNVML.WATTS * dec["seconds"] / 30, rel=0.02)
    assert dec["seconds"] == pytest.approx(0.6, abs=0.1) and dec["verdict"].startswith("memory-bound")
    assert np.isfinite(dec["dram_bw_pct"])
    out = capsys.readouterr().out
    assert '{"new_tokens": 999}' in out and "GPU 0 decode" in out and "GPU 0 load" in out
    assert (tmp_path / "phases.jsonl").exists()


def test_no_gpu_is_a_clear_error(tmp_path):
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        p = subprocess.run([sys.executable, "-m", "numbaengine.profile", "--out", str(tmp_path), "--",
                            sys.executable, "-c", "pass"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "NVML is not available" in p.stderr
    else:
        pytest.skip("this machine has NVML, so the no-NVML error cannot be raised here: CI (no GPU, no NVML) runs it")
