"""Profile every GPU with NVML while a command (or a block of Python) runs: power, SM and memory clocks,
utilization, GPM DRAM-bandwidth and SM utilization, and energy (per generated token when the count is known).

    python -m tools.nvml_profile [--interval 0.1] [--out DIR] [--tokens N] -- python -m numbaengine.run ...

Writes DIR/nvml.csv, DIR/nvml.png (with matplotlib) and DIR/verdict.txt, and prints the verdict. The token count
comes from --tokens, or from the last JSON line the command prints (`tokens` list or `new_tokens` number).
Power readings are NVML's trailing ~1 s average; energy comes from the total-energy counter (the right source
for joules per token); GPM metrics average over each sampling interval (keep it >= 0.1 s).
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

MEMORY_BOUND_PCT = 60.0       # mean DRAM-bandwidth utilization above which a run counts as memory-bound


@dataclass
class Sample:
    t: float              # seconds since start
    gpu: int
    power_w: float
    sm_mhz: int
    mem_mhz: int
    util_gpu: int         # % of time a kernel ran (not occupancy, not bandwidth)
    util_mem: int
    dram_bw_pct: float    # GPM DRAM bandwidth utilization over the last interval (nan when unsupported)
    sm_util_pct: float    # GPM SM utilization over the last interval
    energy_j: float       # energy counter since the start


class Profiler:
    """Context manager sampling all GPUs from a side thread; `.samples`, `.energy_j`, `.power_limit_w` after exit."""

    def __init__(self, interval=0.1):
        import pynvml
        self.nv, self.interval = pynvml, max(interval, 0.1)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise RuntimeError(f"NVML is not available on this machine ({e}): "
                               "nvml_profile needs an NVIDIA GPU") from None
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.power_limit_w = [pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000 for h in self.handles]
        self.samples: list[Sample] = []
        self._stop = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
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


def summarize(samples: list[Sample], energy_j, seconds, power_limit_w, tokens=None) -> list[dict]:
    """Per-GPU means and energy; energy per token when the number of generated tokens is known."""
    rows = []
    for gpu, limit in enumerate(power_limit_w):
        mine = [s for s in samples if s.gpu == gpu]
        mean = (lambda key: sum(getattr(s, key) for s in mine) / len(mine)) if mine else (lambda key: float("nan"))
        rows.append(dict(gpu=gpu, seconds=round(seconds, 3), power_w=round(mean("power_w"), 1), power_limit_w=limit,
                         sm_mhz=round(mean("sm_mhz")), util_gpu=round(mean("util_gpu"), 1),
                         dram_bw_pct=round(mean("dram_bw_pct"), 1), sm_util_pct=round(mean("sm_util_pct"), 1),
                         energy_j=round(energy_j[gpu], 2),
                         j_per_token=round(energy_j[gpu] / tokens, 4) if tokens else None))
    return rows


def verdict(rows: list[dict]) -> str:
    """A short reading of the summary: memory-bound or not, and how much power headroom is left."""
    lines = []
    for r in rows:
        head = f"GPU {r['gpu']}: {r['power_w']:.0f} W of {r['power_limit_w']:.0f} W " \
               f"({100 * r['power_w'] / r['power_limit_w']:.0f}%), DRAM bandwidth {r['dram_bw_pct']}%, " \
               f"SM util {r['sm_util_pct']}%, kernel-busy {r['util_gpu']}%"
        if r["dram_bw_pct"] >= MEMORY_BOUND_PCT:
            kind = "memory-bound: HBM is the limit"
        elif r["util_gpu"] >= 80:
            kind = "busy but not memory-bound: kernels run without saturating HBM (latency, launch or compute bound)"
        else:
            kind = "mostly idle: host-side gaps between kernels dominate"
        energy = f"; {r['j_per_token']} J/token" if r["j_per_token"] is not None else ""
        lines.append(f"{head} -> {kind}{energy}")
    return "\n".join(lines)


def write_outputs(out: Path, samples: list[Sample], rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "nvml.csv", "w", newline="") as f:
        w = csv.DictWriter(f, [fl.name for fl in fields(Sample)])
        w.writeheader()
        w.writerows(asdict(s) for s in samples)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    (out / "verdict.txt").write_text(verdict(rows) + "\n")
    plot(out / "nvml.png", samples)


def plot(path: Path, samples: list[Sample]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("nvml_profile: matplotlib not installed, no plot (pip install -e '.[plot]')", file=sys.stderr)
        return
    keys = ("power_w", "dram_bw_pct", "sm_util_pct", "sm_mhz")
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 8), sharex=True)
    for ax, key in zip(axes, keys):
        for gpu in sorted({s.gpu for s in samples}):
            mine = [s for s in samples if s.gpu == gpu]
            ax.plot([s.t for s in mine], [getattr(s, key) for s in mine], label=f"GPU {gpu}")
        ax.set_ylabel(key)
    axes[-1].set_xlabel("seconds")
    axes[0].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples (>= 0.1)")
    ap.add_argument("--out", default="runs/nvml", help="folder for nvml.csv, nvml.png, verdict.txt")
    ap.add_argument("--tokens", type=int, help="generated tokens, for J/token")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to profile")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to profile after --")
    try:
        prof = Profiler(args.interval)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with prof:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    rows = summarize(prof.samples, prof.energy_j, prof.seconds, prof.power_limit_w,
                     args.tokens or tokens_from_output(proc.stdout))
    write_outputs(Path(args.out), prof.samples, rows)
    print(verdict(rows))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
