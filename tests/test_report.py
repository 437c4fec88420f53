"""tools/report.py: the tables and the goals they decide, from bench / bench_serve JSON drawn at random (seeded)."""
import json

import numpy as np
import pytest

from tools import report

BATCHES = (1, 8, 32, 128)
FIXED = (("ar", 0), ("dflash", 0), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64))


def bench(rng, auto_share):
    """A bench result whose auto rows are auto_share[batch] x the best fixed case, plus a context row (left out)."""
    rows = [dict(mode=m, budget=b, batch=n, tokens_per_s=float(rng.uniform(1e3, 1e5))) for m, b in FIXED
            for n in BATCHES]
    best = {n: max(r["tokens_per_s"] for r in rows if r["batch"] == n) for n in BATCHES}
    rows += [dict(mode="ddtree", budget="auto", batch=n, tokens_per_s=best[n] * auto_share[n]) for n in BATCHES]
    rows.append(dict(mode="ar", budget=0, batch=1, context=8192, tokens_per_s=1.0))
    return dict(rows=rows, gpu="H200", model="pair", date="2026-12-05"), best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_verdict(seed):
    rng = np.random.default_rng(seed)
    share = {n: float(rng.uniform(0.975, 1.2)) for n in BATCHES}
    result, _ = bench(rng, share)
    ratios = report.auto_ratios(report.throughput(result))
    assert ratios.keys() == set(BATCHES) and all(abs(ratios[n] - share[n]) < 1e-12 for n in BATCHES), seed
    text = report.bench_table(result)
    assert "at every batch: yes" in text, (seed, text)
    low = BATCHES[int(rng.integers(len(BATCHES)))]
    share[low] = 0.96
    result, _ = bench(np.random.default_rng(seed), share)
    text = report.bench_table(result)
    assert f"at every batch: no (lowest 0.960 at batch {low})" in text, (seed, text)


def test_table_cells():
    """Each fixed case's cell is its tokens/s and its ratio to AR at that batch; the context row is not a case."""
    rng = np.random.default_rng(5)
    result, _ = bench(rng, dict.fromkeys(BATCHES, 1.0))
    tps = report.throughput(result)
    assert sorted(tps, key=report._order) == ["ar", "dflash", "ddtree-4", "ddtree-16", "ddtree-64", "auto"]
    assert tps["ar"][1] != 1.0                                        # the context row did not replace it
    lines = report.bench_table(result).splitlines()
    row8 = next(line for line in lines if line.startswith("| 8 |")).split(" | ")
    ar, d16 = tps["ar"][8], tps["ddtree-16"][8]
    assert row8[1] == f"{ar:,.0f}" and row8[4] == f"{d16:,.0f} ({d16 / ar:.2f}x)", row8


def test_serve_goals(tmp_path, capsys):
    rng = np.random.default_rng(7)
    result, _ = bench(rng, dict.fromkeys(BATCHES, 1.0))
    b16 = report.throughput(result)["ddtree-16"]
    levels = [{"concurrency": c, "tokens_per_s": b16[c] * s, "ttft_ms": {"p50": t, "p99": 2 * t},
               "tpot_ms": {"p50": 1.0, "p99": 2.0}} for c, s, t in ((1, 0.9, 25.0), (8, 0.9, 40.0), (32, 0.8, 60.0))]
    serve = dict(mode="ddtree", budget=16, levels=levels)
    text = report.serve_table(serve, result)
    assert "concurrency 32: no (0.80)" in text and "concurrency 1 <= 30 ms: yes (25.0 ms)" in text, text
    (tmp_path / "b.json").write_text(json.dumps(result))
    (tmp_path / "s.json").write_text(json.dumps(serve))
    report.main([str(tmp_path / "b.json"), "--serve", str(tmp_path / "s.json")])
    assert "| 32 |" in capsys.readouterr().out


def test_bad_file_is_one_line(tmp_path, capsys):
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: JSONDecodeError") and err.count("\n") == 1, err


def test_auto_replay_rates_by_hand():
    """tools.auto_replay's policies on hand-made rounds: fixed sizes, the rule on this round's and on the round
    before's expectations, and the oracle (which no fixed size beats)."""
    from numbaengine.budget import LADDER
    from tools.auto_replay import rates
    rng = np.random.default_rng(3)
    k = len(LADDER)
    E = np.sort(rng.uniform(0, 3, (6, k)), axis=1)
    E[:, 0] = 0
    A = np.minimum(np.floor(E * rng.uniform(0.5, 1.5, (6, 1))), LADDER).astype(int)
    rows = [(i // 3, E[i], A[i]) for i in range(6)]            # two prompts of three rounds
    secs = np.linspace(1e-3, 2e-3, k)
    ms = secs * 1e3
    got = rates(rows, secs)
    for j, s in enumerate(LADDER):
        assert np.isclose(got[f"fixed {s}"], (1 + A[:, j]).sum() / (6 * ms[j])), (s, got)
    fresh = np.argmax((1 + E) / ms, axis=1)
    assert np.isclose(got["fresh"], (1 + A[np.arange(6), fresh]).sum() / ms[fresh].sum()), got
    before = np.array([E.mean(0), E[0], E[1], E.mean(0), E[3], E[4]])
    lag = np.argmax((1 + before) / ms, axis=1)
    assert np.isclose(got["lagged"], (1 + A[np.arange(6), lag]).sum() / ms[lag].sum()), got
    assert got["oracle"] >= max(v for key, v in got.items() if key != "oracle") - 1e-12, got
    best = max((1 + A[np.arange(6), c]).sum() / ms[list(c)].sum()             # every choice, brute force
               for c in np.ndindex(*(k,) * 6))
    assert np.isclose(got["oracle"], best), (got["oracle"], best)


def test_auto_replay_engine_rule_by_hand():
    """tools.auto_replay's model of the device rounds' rule: where drafting never pays, a probe (priced as size 2's
    round when it chooses the root alone), then coasts of 1, 2, 4 rounds at size 0's cost, the span carried into the
    next prompt, which starts with a probe; where size 2 always pays, every round at size 2 (a probe, then sizes
    chosen from the round before's drafts)."""
    from numbaengine.budget import LADDER
    from tools.auto_replay import engine_rule
    rng = np.random.default_rng(5)
    k = len(LADDER)
    E = np.sort(rng.uniform(0, 2, (10, k)), axis=1)
    E[:, 0] = 0
    A = np.minimum(np.floor(E * rng.uniform(0.5, 1.5, (10, 1))), LADDER).astype(int)
    prompt = np.array([0] * 6 + [1] * 4)
    never = np.array([1.0] + [9.0] * (k - 1))
    # rounds: P C P C C P | P C C C (a new prompt probes; after its probe the coast is 4 long)
    probes = 4
    assert np.isclose(engine_rule(E, A, prompt, never), 10 / (probes * 9.0 + (10 - probes) * 1.0))
    always = np.array([9.0, 1.0] + [9.0] * (k - 2))
    assert np.isclose(engine_rule(E, A, prompt, always), (1 + A[:, 1]).sum() / 10.0)


GPU_TOOLS = ["bench", "bench_attention", "bench_gemm_rules", "bench_kernels", "gemm_wg_stamps", "mla_stamps",
             "moe_stamps", "pdl_probe", "profile_round", "stress_rounds"]


@pytest.mark.parametrize("tool", GPU_TOOLS)
def test_gpu_tool_without_a_gpu_says_so_in_one_line(tool, monkeypatch, capsys):
    """A GPU tool started where the cuda backend cannot run (gpu_ready False) exits with status 2 after one line
    naming the tool and how to install the GPU build, before any GPU work (no traceback)."""
    import importlib

    import tools.gpu
    monkeypatch.setattr(tools.gpu, "gpu_ready", lambda: False)
    monkeypatch.setattr("sys.argv", [f"python -m tools.{tool}"])
    mod = importlib.import_module(f"tools.{tool}")
    with pytest.raises(SystemExit) as e:
        mod.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"python -m tools.{tool}: needs an NVIDIA GPU"), err
    assert err.count("\n") == 1, err
