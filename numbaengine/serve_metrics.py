"""The server's Prometheus metrics, in a registry of their own: requests, tokens, tau, round time, batch
occupancy, queue depth, budget auto's tree sizes and expected against accepted drafts, the process's seconds per
phase (load, compile, capture, prefill, decode) and kernels loaded or compiled, and GPU power and memory from NVML
when it is available (absent otherwise)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from numbaengine import phases
from numbaengine.budget import LADDER
from numbaengine.kernels import cache as kernel_cache
from numbaengine.scheduler import RoundStats

ROUND_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    def __init__(self, max_batch, nvml=True):
        r = self.registry = CollectorRegistry()
        self.max_batch = max_batch
        self.requests = Counter("numbaengine_requests", "Answered requests by path and HTTP status",
                                ["path", "status"], registry=r)
        self.prompt_tokens = Counter("numbaengine_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("numbaengine_generation_tokens", "Completion tokens of finished requests",
                                         registry=r)
        self.tau = Histogram("numbaengine_tau", "Tokens a sequence committed in one round",
                             buckets=tuple(range(1, 33)), registry=r)
        self.round_seconds = Histogram("numbaengine_round_seconds", "Wall time of one batched round",
                                       buckets=ROUND_BUCKETS, registry=r)
        self.batch = Gauge("numbaengine_batch_occupancy", "Sequences in the last round over --max-batch", registry=r)
        self.queue = Gauge("numbaengine_queue_depth", "Requests waiting for a place in the batch", registry=r)
        # budget auto: rate(accepted) / rate(expected) is the drafter's calibration, over calibrated its residual
        self.auto_size = Counter("numbaengine_auto_size_rounds", "Rounds of budget auto by the tree size chosen "
                                 "(drafted nodes per sequence)", ["size"], registry=r)
        self.auto_expected = Counter("numbaengine_auto_expected_drafts", "Budget auto: accepted drafts the drafter's "
                                     "probabilities expected, over sequences and rounds", registry=r)
        self.auto_calibrated = Counter("numbaengine_auto_calibrated_drafts", "Budget auto: the expected accepted "
                                       "drafts calibrated by past rounds (what the choice weighed)", registry=r)
        self.auto_accepted = Counter("numbaengine_auto_accepted_drafts", "Budget auto: drafts the target accepted "
                                     "(tau - 1), over sequences and rounds", registry=r)
        for size in LADDER:
            self.auto_size.labels(str(size))
        r.register(ProcessCollector())
        if nvml and (gpus := NvmlCollector.open()) is not None:
            r.register(gpus)

    def round(self, stats: RoundStats):
        """The scheduler's per-round callback (engine thread)."""
        self.round_seconds.observe(stats.seconds)
        for tau in stats.taus:
            self.tau.observe(tau)
        self.batch.set(stats.batch / self.max_batch)
        self.queue.set(stats.queued)
        for size in {p.size for p in stats.auto}:        # one choice per round: its sequences share the size
            self.auto_size.labels(str(size)).inc()
        self.auto_expected.inc(sum(p.expected for p in stats.auto))
        self.auto_calibrated.inc(sum(p.calibrated for p in stats.auto))
        self.auto_accepted.inc(sum(p.accepted for p in stats.auto))

    def done(self, path, prompt_tokens, completion_tokens):
        self.requests.labels(path, "200").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)


class ProcessCollector:
    """Where the process's time went (numbaengine/phases.py) and what the kernel cache did, read at each scrape: a
    warmed-up server's compile and capture seconds stay flat while it serves."""

    def collect(self):
        seconds = CounterMetricFamily("numbaengine_phase_seconds", "Exclusive seconds spent per phase since start",
                                      labels=["phase"])
        for name, s in sorted({**dict.fromkeys(phases.PHASES, 0.0), **phases.totals()}.items()):
            seconds.add_metric([name], s)
        kernels = CounterMetricFamily("numbaengine_kernels", "Kernels loaded from the cache or compiled",
                                      labels=["how"])
        counts = kernel_cache.stats()
        kernels.add_metric(["loaded"], counts["hits"])
        kernels.add_metric(["compiled"], counts["misses"])
        yield seconds
        yield kernels


class NvmlCollector:
    """Power (W) and used memory (bytes) of every GPU, read at each scrape."""

    def __init__(self, nv, handles):
        self.nv, self.handles = nv, handles

    @classmethod
    def open(cls):
        try:
            import pynvml as nv
            nv.nvmlInit()
            return cls(nv, [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())])
        except Exception:  # noqa: BLE001 - no pynvml, no driver, no GPU: the GPU metrics are absent
            return None

    def collect(self):
        power = GaugeMetricFamily("numbaengine_gpu_power_watts", "GPU power draw (NVML)", labels=["gpu"])
        memory = GaugeMetricFamily("numbaengine_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        for i, h in enumerate(self.handles):
            power.add_metric([str(i)], self.nv.nvmlDeviceGetPowerUsage(h) / 1000)
            memory.add_metric([str(i)], self.nv.nvmlDeviceGetMemoryInfo(h).used)
        yield power
        yield memory
