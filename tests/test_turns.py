"""tools/turns.py: children warm up together, then time one at a time; a failed child stops the rest."""
import json
import os
import sys
import textwrap
import time
import types

import pytest

from tools.turns import run_children

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tools.turns import turn
    folder, i, n, warm, fail = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    time.sleep(warm)
    if fail == "1":
        sys.exit(3)
    with open(folder + "/log", "a") as f:
        f.write(f"warm {{i}} {{time.time()!r}}\\n")
    with turn(folder, i, n, timeout_s=60, poll_s=0.02):
        with open(folder + "/log", "a") as f:
            f.write(f"start {{i}} {{time.time()!r}}\\n")
        time.sleep(0.15)
        with open(folder + "/log", "a") as f:
            f.write(f"end {{i}} {{time.time()!r}}\\n")
""")


def _children(tmp_path, warms, fail=()):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    folder = str(tmp_path / "turns")
    cmds = [[sys.executable, str(script), folder, str(i), str(len(warms)), str(w), "1" if i in fail else "0"]
            for i, w in enumerate(warms)]
    return run_children(cmds, folder, timeout_s=120), folder


def test_turns_warm_together_time_alone(tmp_path):
    warms = [0.4, 0.0, 0.2, 0.1]                       # the slowest to warm is the first child
    codes, folder = _children(tmp_path, warms)
    assert codes == [0] * len(warms)
    events = [line.split() for line in open(folder + "/log")]
    last_warm = max(float(t) for kind, _, t in events if kind == "warm")
    spans = {}
    for kind, i, t in events:
        if kind in ("start", "end"):
            spans.setdefault(int(i), {})[kind] = float(t)
    assert sorted(spans) == list(range(len(warms)))
    starts = sorted((s["start"], s["end"]) for s in spans.values())
    assert starts[0][0] >= last_warm                    # nobody times before everybody has warmed up
    for (s0, e0), (s1, e1) in zip(starts, starts[1:]):
        assert e0 <= s1, (starts, "two timed turns overlap")


def test_turns_failed_sibling_stops_the_rest(tmp_path):
    t0 = time.time()
    codes, folder = _children(tmp_path, [0.0, 0.3, 0.0], fail={1})
    assert codes[1] == 3 and codes[0] != 0 and codes[2] != 0     # the others gave up at the barrier
    assert time.time() - t0 < 30
    assert not os.path.exists(folder + "/log") or "start" not in open(folder + "/log").read()


def test_parallel_mla_merges_the_children(tmp_path, monkeypatch):
    """bench_attention --parallel: one child per variant with the shared options, the rows tagged by variant, the
    copy bandwidths kept per variant; a failed child is an error, not a shorter table."""
    import tools.bench_attention as ba
    import tools.turns as turns
    seen = []

    def fake(cmds, folder):
        seen.extend(cmds)
        for k, c in enumerate(cmds):
            out = c[c.index("--out") + 1]
            with open(out, "w") as f:
                json.dump({"copy_bw_gbs": 4000.0 + k, "mla": [{"ctx": 4096, "us": 10.0 + k}]}, f)
        return [0] * len(cmds)

    monkeypatch.setattr(turns, "run_children", fake)
    monkeypatch.setattr(ba, "MLA_VARIANTS", [{}, {"wg": {"cluster": 0}}])
    args = types.SimpleNamespace(quick=False, mla_shapes='{"ctx": [4096]}', mla_parts=True)
    res = ba.parallel_mla(args, str(tmp_path))["attention"]
    assert res["copy_bw_gbs"] == [4000.0, 4001.0]
    assert res["mla"] == [{"ctx": 4096, "us": 10.0, "variant": {}},
                          {"ctx": 4096, "us": 11.0, "variant": {"wg": {"cluster": 0}}}]
    assert [json.loads(c[c.index("--mla-variant") + 1]) for c in seen] == [{}, {"wg": {"cluster": 0}}]
    assert all(c[c.index("--turn") + 1].endswith(f":{k}:2") and '{"ctx": [4096]}' in c and "--mla-parts" in c
               for k, c in enumerate(seen))

    monkeypatch.setattr(turns, "run_children", lambda cmds, folder: [0, 1])      # variant 0's file is still there
    with pytest.raises(SystemExit, match="variant {'wg': {'cluster': 0}} exited with 1"):
        ba.parallel_mla(args, str(tmp_path))
    with pytest.raises(SystemExit, match="exited with 0 and wrote no"):
        ba.parallel_mla(args, str(tmp_path / "elsewhere"))


def test_split_merge_us_times_each_half(monkeypatch):
    """bench_attention --mla-parts: the call timed with merge_splits recorded and skipped, then the recorded merge
    alone; kernels.mla.merge_splits is restored; a call that merges in the kernel gives (None, None)."""
    import numbaengine.kernels.mla as km
    import tools.bench_attention as ba
    timed, merged = [], []

    def fake_merge(*a):
        merged.append(a)
    monkeypatch.setattr(km, "merge_splits", fake_merge)

    def fake_gpu_us(fn):
        fn()
        timed.append(len(timed))
        return 10.0 * len(timed), "graph"
    monkeypatch.setattr(ba, "gpu_us", fake_gpu_us)
    assert ba.split_merge_us(lambda: km.merge_splits("o", "ml", "out")) == (10.0, 20.0)
    assert merged == [("o", "ml", "out")]           # only the merge-alone pass reached the real (here: fake) merge
    assert km.merge_splits is fake_merge
    timed.clear()
    assert ba.split_merge_us(lambda: None) == (None, None) and timed == [0]
