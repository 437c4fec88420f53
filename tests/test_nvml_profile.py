"""The NVML profiler's summary, verdict and outputs on synthetic samples (the sampling itself needs a GPU)."""
import json

import pytest

from tools.nvml_profile import (
    Profiler,
    Sample,
    summarize,
    tokens_from_output,
    verdict,
    write_outputs,
)


def samples(dram, util, power):
    return [Sample(0.1 * i, 0, power, 1980, 3201, util, 50, dram, 90.0, 10.0 * i) for i in range(1, 11)]


@pytest.mark.parametrize("dram,util,expect", [(82.0, 100, "memory-bound"), (3.0, 96, "busy but not memory-bound"),
                                              (2.0, 10, "mostly idle")])
def test_verdict_reads_the_signature(dram, util, expect):
    rows = summarize(samples(dram, util, 205.0), [100.0], 1.0, [700.0], tokens=50)
    assert rows[0]["j_per_token"] == pytest.approx(2.0)
    assert rows[0]["dram_bw_pct"] == pytest.approx(dram)
    text = verdict(rows)
    assert expect in text and "205 W of 700 W (29%)" in text


def test_outputs_written(tmp_path):
    rows = summarize(samples(50.0, 90, 300.0), [30.0], 1.0, [700.0])
    write_outputs(tmp_path, samples(50.0, 90, 300.0), rows)
    assert (tmp_path / "nvml.csv").read_text().count("\n") == 11
    assert json.loads((tmp_path / "summary.json").read_text())[0]["j_per_token"] is None
    assert "GPU 0" in (tmp_path / "verdict.txt").read_text()


def test_token_count_from_json_line():
    assert tokens_from_output('progress\n{"tokens": [1, 2, 3], "text": "x"}\n') == 3
    assert tokens_from_output('{"new_tokens": 7}') == 7
    assert tokens_from_output("no json here") is None


def test_no_gpu_is_a_clear_error():
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        with pytest.raises(RuntimeError, match="NVML is not available"):
            Profiler()
    else:
        pytest.skip("this machine has NVML, so the no-NVML error cannot be raised here: CI (no GPU, no NVML) runs it")
