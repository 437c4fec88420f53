"""What the server's host path costs, on any CPU: numbaengine.serve over a stand-in for the device rounds (each round
sleeps a fixed time, as a graph launch and its sync release the GIL, then commits tau random tokens per sequence),
loaded by tools.bench_serve. Served tokens/s are set beside the ceiling (concurrency x tau / round time) and beside
the engine loop alone (generate.generate_on over the same stand-in), so the host's share of a served round shows
before a GPU run. The server's own CPU per 1,000 served tokens (event loop and other threads, from /proc) is the
host cost the load generator does not bound.

    python -m tools.serve_overhead --round-ms 1.0 --tau 4 --concurrency 1,8,32 --max-tokens 64 [--out FILE]

The load generator runs on the same machine as the server: on a 2-core machine one openai-client process is the
limit from about 35,000 served tokens/s (it used a whole core), so read short rounds with that in mind.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from numbaengine.device_round import Shape
from numbaengine.rounds import PREFILL_CHUNK, DeviceSlots

BUDGET = 16


class StandInRounds:
    """DeviceRounds' interface for DeviceSlots: prefill returns a token at once, a round commits tau tokens (random
    ids, no eos) for every slot and takes round_s: start() launches it (notes the time), finish() waits until
    round_s after the launch, as a GPU round runs while the host goes on."""

    def __init__(self, shape, round_s, tau, vocab, avoid, seed=0):
        self.shape, self.round_s, self.tau, self.gpu_s = shape, round_s, tau, 0.0
        self.rng = np.random.default_rng(seed)
        self.pool = np.setdiff1d(np.arange(vocab), list(avoid)).astype(np.int32)
        self.outs = np.zeros((64, shape.batch, tau + 2), np.int32)     # rounds handed out in turn: no host work
        self.outs[:, :, 0] = tau                                       # of the stand-in's own in the loop
        self.outs[:, :, 1:tau + 1] = self.rng.choice(self.pool, (64, shape.batch, tau))
        self.rounds, self.launched = 0, 0.0

    def retire(self, slots):
        pass

    def prefill_part(self, b, ids, start, end):
        pass

    def prefill(self, b, ids, seq_index, temperature=0.0, seed=0, budget=None, start=0) -> int:
        return int(self.rng.choice(self.pool))

    def start(self, size=None):
        self.launched = time.perf_counter()

    def finish(self) -> np.ndarray:
        left = self.launched + self.round_s - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self.gpu_s += self.round_s
        self.rounds += 1
        return self.outs[self.rounds % len(self.outs)]

    def step(self, size=None) -> np.ndarray:
        self.start(size)
        return self.finish()


def stand_in_slots(engine, batch, round_s, tau) -> DeviceSlots:
    """DeviceSlots of `batch` slots whose rounds (ddtree, budget 16) are a StandInRounds."""
    slots = DeviceSlots(engine.target, engine.drafter, engine.max_context, batch, PREFILL_CHUNK)
    shape = Shape(batch, "ddtree", BUDGET, engine.max_context, ())
    slots.cache[shape] = StandInRounds(shape, round_s, tau, engine.cfg.vocab_size, engine.cfg.eos_ids)
    return slots


def engine_loop(engine, concurrency, round_s, tau, max_tokens, prompts) -> float:
    """tokens/s of generate_on over the stand-in: concurrency prompts decoded together to max_tokens each."""
    from numbaengine import generate as gen
    slots = stand_in_slots(engine, concurrency, round_s, tau)
    ids = [engine.tokenizer.encode(prompts[i % len(prompts)]) for i in range(concurrency)]
    t0 = time.perf_counter()
    res = gen.generate_on(slots, engine.tokenizer, ids, max_tokens, "ddtree", BUDGET, stop=[])
    return sum(len(r.tokens) for r in res) / (time.perf_counter() - t0)


def serve(args):
    """The server over the stand-in (a child process of main)."""
    import uvicorn

    from numbaengine.engine import Engine
    from numbaengine.scheduler import Scheduler
    from numbaengine.serve import build_app
    from numbaengine.serve_metrics import Metrics
    engine = Engine.load(backend="numpy")
    metrics = Metrics(args.max_batch)
    rounds = stand_in_slots(engine, args.max_batch, args.round_ms / 1e3, args.tau)
    scheduler = Scheduler(engine, args.max_batch, 4 * args.max_batch, metrics.round, None, PREFILL_CHUNK, rounds)
    app = build_app(engine, scheduler, metrics, "stand-in", dict(mode="ddtree", budget=BUDGET))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def thread_cpu(pid) -> dict | None:
    """CPU seconds (user + system) of each live thread of process pid (Linux /proc; None elsewhere): a thread that
    ends between two readings is not counted (the server's threads live as long as it does)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for t in tasks.iterdir():
        try:
            fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:                              # the thread ended meanwhile
            continue
        out[int(t.name)] = (int(fields[11]) + int(fields[12])) / tick     # utime, stime
    return out


def cpu_per_token(before, after, pid, tokens) -> dict | None:
    """Server CPU milliseconds per 1,000 served tokens between two thread_cpu readings: its main thread (the event
    loop) and the others together (the engine thread, uvicorn's and the BLAS threads)."""
    if before is None or after is None or not tokens:
        return None
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = spent.pop(pid, 0.0)
    return {"event_loop": 1e6 * main / tokens, "other": 1e6 * sum(spent.values()) / tokens}


def wait_for(proc, url, timeout=120.0):
    import httpx
    until = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < until:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"serve_overhead: no stand-in server at {url} (exit code {proc.poll()})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round-ms", type=float, default=1.0, help="the stand-in's round time")
    ap.add_argument("--tau", type=int, default=4, help="tokens each sequence commits per round")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per level, as a multiple of its concurrency")
    ap.add_argument("--out", help="write the levels as JSON here")
    ap.add_argument("--serve-stand-in", action="store_true", help=argparse.SUPPRESS)   # the child: the server
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_stand_in:
        return serve(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tools.serve_overhead", "--serve-stand-in", "--port", str(port), "--max-batch",
           str(max(levels)), "--round-ms", str(args.round_ms), "--tau", str(args.tau)]
    proc = subprocess.Popen(cmd)
    try:
        from numbaengine.engine import Engine
        from tools import bench_serve
        from tools.acceptance import DEFAULT_PROMPTS, load_prompts
        engine, prompts = Engine.load(backend="numpy"), load_prompts(DEFAULT_PROMPTS, 64)
        loop = {c: engine_loop(engine, c, args.round_ms / 1e3, args.tau, args.max_tokens, prompts) for c in levels}
        wait_for(proc, f"http://127.0.0.1:{port}/health")
        served, cpu = [], {}
        with tempfile.TemporaryDirectory() as d:
            out = Path(d, "serve.json")
            for c in levels:                             # one level a call: the server's CPU counted around it
                before = thread_cpu(proc.pid)
                bench_serve.main(["--url", f"http://127.0.0.1:{port}", "--concurrency", str(c), "--max-tokens",
                                  str(args.max_tokens), "--out", str(out), "--timeout", "120", "--requests",
                                  str(args.requests * max(levels))])
                lv = json.loads(out.read_text())["levels"][0]
                served.append(lv)                      # (+ the untimed pass of c requests: --warmup 1)
                cpu[c] = cpu_per_token(before, thread_cpu(proc.pid), proc.pid, lv["tokens"] + c * args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows = []
    print(f"\nstand-in round {args.round_ms} ms, tau {args.tau}, {args.max_tokens} tokens per request")
    print("| concurrency | ceiling tok/s | engine loop tok/s | served tok/s | served / loop | TTFT p50 ms | ITL p50 ms"
          " | server CPU ms / 1k tokens: event loop, other threads |")
    print("|---|---|---|---|---|---|---|---|")
    for lv in served:
        c = lv["concurrency"]
        ceiling = c * args.tau / (args.round_ms / 1e3)
        row = dict(concurrency=c, ceiling=ceiling, loop=loop[c], served=lv["tokens_per_s"],
                   ttft_p50_ms=lv["ttft_ms"].get("p50"), itl_p50_ms=lv["itl_ms"].get("p50"), cpu_ms_per_1k=cpu[c])
        rows.append(row)
        cpu_cell = ", ".join(f"{cpu[c][k]:.1f}" for k in ("event_loop", "other")) if cpu[c] else "n/a"
        print(f"| {c} | {ceiling:,.0f} | {loop[c]:,.0f} ({loop[c] / ceiling:.2f}) | {row['served']:,.0f} "
              f"({row['served'] / ceiling:.2f}) | {row['served'] / loop[c]:.2f} | {row['ttft_p50_ms']:.1f} | "
              f"{row['itl_p50_ms']:.2f} | {cpu_cell} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(round_ms=args.round_ms, tau=args.tau, max_tokens=args.max_tokens,
                                                  levels=rows), indent=1))


if __name__ == "__main__":
    main()
