"""Load generator for the HTTP server (numbaengine/serve.py): streamed completions through the official openai
client (AsyncOpenAI) at each concurrency of a sweep, over the held-out prompts (tools/train/heldout.json).

    python -m numbaengine.serve --port 8000 &
    python -m tools.bench_serve --url http://127.0.0.1:8000 --concurrency 1,8,32,128 --out serve.json
    python -m tools.bench_serve --serve "--backend cuda" --concurrency 1,8,32,128 --out serve.json   # a server per
                                                                                 # level, --max-batch = concurrency

Per level: TTFT (request sent -> first text), TPOT ((last text - first text) / (completion tokens - 1)), ITL (gap
between streamed chunks: one chunk per committed round, so a chunk holds tau tokens), p50 and p99 of each, and
tokens/s = completion tokens of all requests over the level's wall time. JSON + a table. The streams of a level are
dealt among load-generator processes (--processes; default one per 16 streams, at most half the cores), since one
Python process parsing 32 or more streams falls behind a fast server.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np

from numbaengine.run import budget_arg
from tools.acceptance import DEFAULT_PROMPTS, load_prompts


@dataclass
class Sample:
    ttft: float = float("nan")
    tpot: float = float("nan")
    itl: list = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def one(client, model, prompt, args, seed) -> Sample:
    s, t0, last = Sample(), time.perf_counter(), None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                 temperature=args.temperature, seed=seed, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extension(args))
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                s.tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if last is None:
                s.ttft = now - t0
                first = now
            else:
                s.itl.append(now - last)
            last = now
        if last is not None and s.tokens > 1:
            s.tpot = (last - first) / (s.tokens - 1)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the sweep goes on
        s.error = f"{type(e).__name__}: {e}"
    return s


def extension(args) -> dict:
    """The requests' extra body: the speculative mode and budget given (those not given: the server's)."""
    spec = {k: v for k, v in (("mode", args.mode), ("budget", args.budget)) if v is not None}
    return {"speculative": spec} if spec else {}


async def requests(client, model, prompts, concurrency, indices, args) -> list:
    """Requests `indices` (prompt and seed by index), at most `concurrency` in flight -> their Samples."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(i):
        async with gate:
            return await one(client, model, prompts[i % len(prompts)], args, args.seed + (i if args.vary_seed else 0))
    return await asyncio.gather(*(gated(i) for i in indices))


def share(model, prompts, concurrency, indices, args, start_at) -> tuple:
    """One load-generator process of a level: its requests from wall-clock time start_at -> (Samples, end time)."""
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                             timeout=args.timeout)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await requests(client, model, prompts, concurrency, indices, args)
    samples = asyncio.run(run())
    return samples, time.time()


def processes_for(concurrency, asked) -> int:
    """Load-generator processes of a level: `asked`, or (None) one per 16 streams, at most half the cores: one
    Python process parsing the streams of 32 or more falls behind a fast server and under-reports it."""
    if asked is not None:
        return max(1, min(asked, concurrency))
    return max(1, min(math.ceil(concurrency / 16), (os.cpu_count() or 2) // 2))


async def level(client, model, prompts, concurrency, n, args) -> dict:
    """n requests (prompts in turn), at most `concurrency` in flight, from processes_for(...) processes (the
    concurrency and the requests dealt among them)."""
    procs = processes_for(concurrency, args.processes)
    t0 = time.perf_counter()
    if procs == 1:
        samples = await requests(client, model, prompts, concurrency, range(n), args)
        wall = time.perf_counter() - t0
    else:
        start_at = time.time() + 2.0                     # every process made and its client ready by then
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = [pool.submit(share, model, prompts, len(range(p, concurrency, procs)), range(p, n, procs), args,
                                start_at) for p in range(procs)]
            done = [await asyncio.wrap_future(j) for j in jobs]
        samples, wall = [s for d in done for s in d[0]], max(d[1] for d in done) - start_at
    ok = [s for s in samples if s.error is None]

    def pct(values):
        v = np.array([x for x in values if not math.isnan(x)], np.float64) * 1e3
        return dict(p50=float(np.percentile(v, 50)), p99=float(np.percentile(v, 99))) if len(v) else {}

    tokens = sum(s.tokens for s in ok)
    return dict(concurrency=concurrency, requests=n, processes=procs, errors=len(samples) - len(ok),
                first_error=next((s.error for s in samples if s.error), None), wall_s=wall,
                tokens=tokens, tokens_per_s=tokens / wall, requests_per_s=len(ok) / wall,
                ttft_ms=pct(s.ttft for s in ok), tpot_ms=pct(s.tpot for s in ok),
                itl_ms=pct(x for s in ok for x in s.itl))


def table(rows) -> str:
    head = f"{'conc':>5} {'reqs':>5} {'err':>4} {'tok/s':>9} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} " \
           f"{'ITL p50/p99 ms':>17}"
    lines = [head]
    for r in rows:
        cell = lambda d: f"{d.get('p50', float('nan')):8.1f}/{d.get('p99', float('nan')):<8.1f}"
        lines.append(f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} {r['tokens_per_s']:>9.1f} "
                     f"{cell(r['ttft_ms'])} {cell(r['tpot_ms'])} {cell(r['itl_ms'])}")
    return "\n".join(lines)


async def sweep(args) -> list:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=args.timeout)
    prompts = load_prompts(args.prompts_file, args.prompts)
    rows = []
    for c in args.concurrency:
        with server(args, c):
            model = args.model or (await client.models.list()).data[0].id
            for _ in range(args.warmup):            # untimed: the server's first rounds at this load
                await requests(client, model, prompts, c, range(c), args)
            rows.append(await level(client, model, prompts, c, args.requests or max(8 * c, 32), args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


@contextlib.contextmanager
def server(args, concurrency):
    """With --serve: `python -m numbaengine.serve ARGS --port <--url's> --max-batch <concurrency>` for one level
    (a round on the kernel backends covers max-batch slots: each level gets rounds of its own size), stopped after
    it (SIGTERM: drained); without, nothing (the server at --url serves every level)."""
    if not args.serve:
        yield
        return
    import httpx
    port = str(urlparse(args.url).port or 8000)
    cmd = [sys.executable, "-m", "numbaengine.serve", *shlex.split(args.serve), "--port", port,
           "--max-batch", str(concurrency)]
    proc = subprocess.Popen(cmd)
    try:
        until = time.monotonic() + args.timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(args.url.rstrip("/") + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > until:
                raise SystemExit(f"bench_serve: no server at {args.url} after {args.timeout:.0f} s: {' '.join(cmd)}")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def parser():
    ap = argparse.ArgumentParser(prog="python -m tools.bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, help="requests per level (default: 8 x the concurrency, at least 32: "
                    "each stream runs 8 requests back to back, so ramp-up and drain are a small part of the level)")
    ap.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts to cycle through")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vary-seed", action="store_true", help="request i samples with seed + i (one batch mixes seeds)")
    ap.add_argument("--mode", choices=("ddtree", "dflash", "ar"), help="speculative mode (default: the server's)")
    ap.add_argument("--budget", type=budget_arg, help="DDTree budget, or auto: chosen each round (default: the "
                    "server's)")
    ap.add_argument("--processes", type=int, help="load-generator processes per level (default: one per 16 "
                    "streams, at most half the cores)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes of `concurrency` requests before each "
                    "level's timed ones, so a fresh server's first rounds (graph captures, kernels) are not timed "
                    "(default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--serve", metavar="ARGS", help='start "python -m numbaengine.serve ARGS" for each level on '
                    "--url's port, with --max-batch set to the level's concurrency, and stop it after the level")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    print(table([]), flush=True)
    rows = asyncio.run(sweep(args))
    result = dict(url=args.url, serve=args.serve, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                  vary_seed=args.vary_seed, mode=args.mode, budget=args.budget, warmup=args.warmup, levels=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
