"""Profile the GPUs with NVML while a command runs, phase by phase: power, energy, clocks, utilization and GPM
DRAM-bandwidth / SM utilization, with a verdict and joules per token for each phase of the work.

    python -m numbaengine.profile --out DIR -- python -m tools.bench --synth-k2 2 --modes ar --hold-seconds 10

The command runs with NUMBAENGINE_PHASES=DIR/phases.jsonl, where numbaengine/phases.py appends its spans (load,
compile, capture, prefill, decode, and any the command adds). Writes DIR/nvml.csv (samples, each with its phase),
DIR/nvml.png (phases shaded; needs matplotlib), DIR/summary.json and DIR/verdict.txt, and prints the verdict.
A phase's energy is the energy counter's difference across its spans; J/token divides it by the tokens recorded for
the phase (phases.record), else by --tokens or the last JSON line the command prints (`new_tokens` or `tokens`).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from numbaengine.phases import PHASES

MEMORY_BOUND_PCT = 60.0       # mean DRAM-bandwidth utilization above which a phase counts as memory-bound
BUSY_PCT = 80.0               # kernel-busy % above which a phase that is not memory-bound counts as busy
MIN_SAMPLES = 3               # fewer samples in a phase: no verdict
OTHER = "other"               # time inside no span


@dataclass
class Sample:
    t: float              # seconds since start
    gpu: int
    power_w: float        # NVML's trailing ~1 s average
    sm_mhz: int
    mem_mhz: int
    util_gpu: int         # % of time a kernel ran (not occupancy, not bandwidth)
    util_mem: int
    dram_bw_pct: float    # GPM DRAM bandwidth utilization over the last interval (nan when unsupported)
    sm_util_pct: float    # GPM SM utilization over the last interval
    energy_j: float       # energy counter since the start


class Profiler:
    """Context manager sampling all GPUs from a side thread; `.samples`, `.energy_j`, `.seconds`, `.power_limit_w`
    after exit, `.wall0` (Unix time of t = 0). `nvml`: the pynvml module, or a stand-in for tests."""

    def __init__(self, interval=0.1, nvml=None):
        if nvml is None:
            import pynvml as nvml
        self.nv, self.interval = nvml, max(interval, 0.1)
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise RuntimeError(f"NVML is not available on this machine ({e}): "
                               "numbaengine.profile needs an NVIDIA GPU") from None
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.power_limit_w = [nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000 for h in self.handles]
        self.samples: list[Sample] = []
        self._stop = threading.Event()

    def __enter__(self):
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self.e0 = [self.nv.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]
        self.gpm = [self._gpm_sample(h) for h in self.handles]
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.energy_j = [(self.nv.nvmlDeviceGetTotalEnergyConsumption(h) - e0) / 1000
                         for h, e0 in zip(self.handles, self.e0)]
        self.seconds = time.perf_counter() - self.t0

    def _loop(self):
        while not self._stop.wait(self.interval):
            for i, h in enumerate(self.handles):
                self.samples.append(self._read(i, h))

    def _read(self, i, h) -> Sample:
        nv = self.nv
        util = nv.nvmlDeviceGetUtilizationRates(h)
        dram, sm = self._gpm_metrics(i, h)
        return Sample(round(time.perf_counter() - self.t0, 4), i, nv.nvmlDeviceGetPowerUsage(h) / 1000,
                      nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                      util.gpu, util.memory, dram, sm,
                      (nv.nvmlDeviceGetTotalEnergyConsumption(h) - self.e0[i]) / 1000)

    def _gpm_sample(self, h):
        nv = self.nv
        try:
            if not nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                return None
            s = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(h, s)
            return s
        except nv.NVMLError:
            return None

    def _gpm_metrics(self, i, h):
        """(DRAM bandwidth %, SM utilization %) between the previous GPM sample and now."""
        nv, prev = self.nv, self.gpm[i]
        cur = self._gpm_sample(h) if prev is not None else None
        if cur is None:
            return float("nan"), float("nan")
        m = nv.c_nvmlGpmMetricsGet_t()
        m.version, m.numMetrics, m.sample1, m.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 2, prev, cur
        m.metrics[0].metricId, m.metrics[1].metricId = nv.NVML_GPM_METRIC_DRAM_BW_UTIL, nv.NVML_GPM_METRIC_SM_UTIL
        nv.nvmlGpmMetricsGet(m)
        nv.nvmlGpmSampleFree(prev)
        self.gpm[i] = cur
        return m.metrics[0].value, m.metrics[1].value


def read_phases(path: Path) -> list[dict]:
    """The JSON lines of a phases file (a line cut short by a killed process is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def segments(records: list[dict], wall0: float, seconds: float) -> list[tuple[str, float, float]]:
    """Consecutive (phase, t0, t1) covering [0, seconds], t in seconds since wall0: where spans nest, the innermost
    (latest started) one owns the time, as in phases.py; time in no span is OTHER."""
    spans = sorted((r["start"] - wall0, wall0 - r["end"], r["phase"]) for r in records if "start" in r)
    cuts = sorted({0.0, seconds, *(min(max(t, 0.0), seconds) for s0, e, _ in spans for t in (s0, -e))})
    out, active, i = [], [], 0
    for a, b in itertools.pairwise(cuts):
        while i < len(spans) and spans[i][0] <= a:
            active.append(spans[i])
            i += 1
        active = [sp for sp in active if -sp[1] >= b]                # (start, -end, name): still open at b
        name = max(active)[2] if active else OTHER                  # latest start, then the shorter one
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], b)
        elif b > a:
            out.append((name, a, b))
    return out


def phases_at(segs, times) -> list[str]:
    """The phase owning each time (segs as segments() returns them: consecutive, in order)."""
    i = np.searchsorted([a for _, a, _ in segs], times, side="right") - 1
    return [segs[k][0] if k >= 0 and t < segs[k][2] else OTHER for k, t in zip(i, times)]


def recorded_tokens(records: list[dict]) -> dict[str, int]:
    """Tokens per phase from phases.record lines (e.g. {"decode": 2560})."""
    out: dict[str, int] = {}
    for r in records:
        if isinstance(r.get("tokens"), int):
            out[r["phase"]] = out.get(r["phase"], 0) + r["tokens"]
    return out


def summarize(samples, energy_j, seconds, power_limit_w, segs, interval, tokens=None) -> list[dict]:
    """One row per GPU and phase ("all" first, then the phases in order of appearance). tokens: {phase: count}
    ("all": the decode count). A sample belongs to the phase at the middle of the interval it measures (GPM and
    utilization are averages over the time since the previous sample)."""
    tokens = tokens or {}
    names = ["all"] + list(dict.fromkeys(name for name, _, _ in segs))
    rows = []
    for gpu, limit in enumerate(power_limit_w):
        mine = [s for s in samples if s.gpu == gpu]
        label = phases_at(segs, [s.t - interval / 2 for s in mine])
        t = [0.0] + [s.t for s in mine] + [seconds]
        e = [0.0] + [s.energy_j for s in mine] + [energy_j[gpu]]
        for name in names:
            own = [(0.0, seconds)] if name == "all" else [(a, b) for n, a, b in segs if n == name]
            inside = mine if name == "all" else [s for s, n in zip(mine, label) if n == name]
            count = tokens.get(name, tokens.get("decode") if name == "all" else None)
            rows.append(phase_row(gpu, name, own, inside, (t, e), limit, count))
    return rows


def phase_row(gpu, name, own, inside, curve, limit, count) -> dict:
    """Means and energy of one phase: `own` its (t0, t1) intervals, `inside` its samples, curve the (t, energy_j)
    points the energy counter gave (interpolated at the intervals' ends)."""
    seconds = sum(b - a for a, b in own)
    energy = sum(float(np.interp(b, *curve) - np.interp(a, *curve)) for a, b in own)
    mean = (lambda key: float(np.mean([getattr(s, key) for s in inside]))) if inside else (lambda key: float("nan"))
    row = dict(gpu=gpu, phase=name, seconds=round(seconds, 3), spans=len(own), samples=len(inside),
               energy_j=round(energy, 2), power_w=round(energy / seconds, 1) if seconds > 0 else float("nan"),
               power_limit_w=limit, sm_mhz=round(mean("sm_mhz"), 0), util_gpu=round(mean("util_gpu"), 1),
               dram_bw_pct=round(mean("dram_bw_pct"), 1), sm_util_pct=round(mean("sm_util_pct"), 1),
               tokens=count, j_per_token=round(energy / count, 4) if count else None)
    row["verdict"] = reading(row)
    return row


def reading(row: dict) -> str:
    """Memory-bound, busy, idle, or too short to say."""
    if row["samples"] < MIN_SAMPLES:
        return f"too short to sample ({1e3 * row['seconds']:.0f} ms): hold it longer (--hold-seconds)"
    if row["dram_bw_pct"] >= MEMORY_BOUND_PCT:
        return "memory-bound: HBM is the limit"
    if row["util_gpu"] >= BUSY_PCT:
        return "busy but not memory-bound: kernels run without saturating HBM (latency, launch or compute bound)"
    return "mostly idle: host-side gaps between kernels dominate"


def verdict(rows: list[dict]) -> str:
    """One line per GPU and phase: time, power against the limit, bandwidth, utilization, reading, J/token."""
    lines = []
    for r in rows:
        head = f"GPU {r['gpu']} {r['phase']:<11s}{r['seconds']:8.2f} s"
        if r["samples"] >= MIN_SAMPLES:
            head += (f"  {r['power_w']:.0f} W of {r['power_limit_w']:.0f} W "
                     f"({100 * r['power_w'] / r['power_limit_w']:.0f}%), DRAM bandwidth {r['dram_bw_pct']}%, "
                     f"SM util {r['sm_util_pct']}%, kernel-busy {r['util_gpu']}%")
        energy = f"; {r['j_per_token']} J/token" if r["j_per_token"] is not None else ""
        lines.append(f"{head} -> {r['verdict']}{energy}")
    return "\n".join(lines)


def write_outputs(out: Path, samples: list[Sample], segs, rows: list[dict], interval: float) -> None:
    """nvml.csv (samples with their phase), summary.json, verdict.txt, nvml.png."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "nvml.csv", "w", newline="") as f:
        w = csv.DictWriter(f, [fl.name for fl in fields(Sample)] + ["phase"])
        w.writeheader()
        label = phases_at(segs, [s.t - interval / 2 for s in samples])
        w.writerows(dict(asdict(s), phase=n) for s, n in zip(samples, label))
    nan_free = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
    summary = dict(interval_s=interval, segments=[list(s) for s in segs], rows=nan_free)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "verdict.txt").write_text(verdict(rows) + "\n")
    plot(out / "nvml.png", samples, segs)


def plot(path: Path, samples: list[Sample], segs) -> None:
    """Power, DRAM bandwidth, SM utilization and clock over time, each phase a shaded band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("profile: matplotlib not installed, no plot (pip install -e '.[plot]')", file=sys.stderr)
        return
    names = [n for n in dict.fromkeys(name for name, _, _ in segs) if n != OTHER]
    order = list(PHASES) + [n for n in names if n not in PHASES]                 # a phase keeps its color
    color = {n: plt.cm.tab10(order.index(n) % 10) for n in names}
    keys = ("power_w", "dram_bw_pct", "sm_util_pct", "sm_mhz")
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 8), sharex=True)
    for ax, key in zip(axes, keys):
        for name, a, b in segs:
            if name != OTHER:
                ax.axvspan(a, b, color=color[name], alpha=0.25, lw=0)
        for gpu in sorted({s.gpu for s in samples}):
            mine = [s for s in samples if s.gpu == gpu]
            ax.plot([s.t for s in mine], [getattr(s, key) for s in mine], label=f"GPU {gpu}")
        ax.set_ylabel(key)
    axes[-1].set_xlabel("seconds")
    handles = axes[0].get_legend_handles_labels()[0] + [Patch(color=color[n], alpha=0.25, label=n) for n in names]
    axes[0].legend(handles=handles, loc="upper right", fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def tokens_from_output(text: str):
    """The generated-token count from the last JSON line a command printed, if any."""
    for line in reversed(text.strip().splitlines()):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            if isinstance(obj.get("new_tokens"), int):
                return obj["new_tokens"]
            if isinstance(obj.get("tokens"), list):
                return len(obj["tokens"])
    return None


def run_teed(cmd, env) -> tuple[int, str]:
    """Run cmd, echoing its stdout as it comes; (exit status, stdout)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines)


def token_counts(records, given, output) -> dict[str, int]:
    """Tokens per phase: recorded by the command; else --tokens or its output, counted for decode (or the run)."""
    recorded = recorded_tokens(records)
    count = given or (None if recorded else tokens_from_output(output))
    if not count:
        return recorded
    return {"decode" if any(r["phase"] == "decode" for r in records) else "all": count}


def main(argv=None, nvml=None):
    ap = argparse.ArgumentParser(prog="python -m numbaengine.profile", description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples (>= 0.1)")
    ap.add_argument("--out", default="runs/profile", help="folder for nvml.csv, nvml.png, summary.json, verdict.txt")
    ap.add_argument("--tokens", type=int, help="tokens decoded, for J/token (default: what the command reports)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to profile")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to profile after --")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases_file = (out / "phases.jsonl").resolve()
    phases_file.unlink(missing_ok=True)
    try:
        prof = Profiler(args.interval, nvml)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with prof:
        try:
            rc, text = run_teed(cmd, dict(os.environ, NUMBAENGINE_PHASES=str(phases_file)))
        except FileNotFoundError:
            print(f"error: command not found: {cmd[0]}", file=sys.stderr)
            return 127
    records = read_phases(phases_file)
    segs = segments(records, prof.wall0, prof.seconds)
    tokens = token_counts(records, args.tokens, text)
    rows = summarize(prof.samples, prof.energy_j, prof.seconds, prof.power_limit_w, segs, prof.interval, tokens)
    write_outputs(out, prof.samples, segs, rows, prof.interval)
    print(verdict(rows))
    return rc


if __name__ == "__main__":
    sys.exit(main())
