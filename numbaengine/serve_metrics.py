"""The server's Prometheus metrics, in a registry of their own: requests, tokens, tau, round time, batch
occupancy, queue depth, and GPU power and memory from NVML when it is available (absent otherwise)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

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
        if nvml and (gpus := NvmlCollector.open()) is not None:
            r.register(gpus)

    def round(self, stats: RoundStats):
        """The scheduler's per-round callback (engine thread)."""
        self.round_seconds.observe(stats.seconds)
        for tau in stats.taus:
            self.tau.observe(tau)
        self.batch.set(stats.batch / self.max_batch)
        self.queue.set(stats.queued)

    def done(self, path, prompt_tokens, completion_tokens):
        self.requests.labels(path, "200").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)


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
