"""End-to-end decoding benchmark on the cuda backend: tokens/s, tau, round time split into GPU and host, time per
phase, and each round's HBM byte floor against the copy bandwidth measured in the same run. JSON + a table.

    python -m tools.bench --out bench.json                              (the shipped pair)
    python -m tools.bench --synth-k2 2 --modes ar,ddtree --budgets 16   (a K2.6-shaped checkpoint made here)
    python -m numbaengine.profile --out DIR -- python -m tools.bench --synth-k2 2 --modes ar --hold-seconds 10
    python -m tools.bench --synth-k2 61 --rank-of 8 --modes ar,ddtree   (one GPU's share of the 8-GPU layout)

The shipped pair decodes its 8 held-out prompts (tools/train/heldout.json) per case, in consecutive batches, so
tau is pooled over them (tokens committed over rounds, all prompts together; `tau_prompt_mean` keeps the mean of
the per-prompt taus, which varied 1.7-6.1 at budget 16), tokens/s is total new tokens over decode time. Rounds are
CUDA-graph replays (numbaengine/device_round.py). `gpu ms` is the device time of a round (events around the graph
launch), `host %` the rest of the wall time per round (launch, the out_tokens read, Python). Phase times come from the
round captured as one graph per phase, each replayed between events (GPU time only). Byte floor of a round = weights
read once (attention, dense and shared MLPs, lm_head for verify and for the draft, the drafter) + routed experts
touched (the expected number of distinct experts for the round's tokens under uniform random routing: synthetic
checkpoints route about uniformly; a trained one does not) + latent cache and drafter context rows. `floor %` =
floor bytes / copy bandwidth / gpu time; the % after a phase's time is that phase's own floor (`phase_floors`:
e.g. commit = fc + the drafter's k|v rows) over its GPU time and the copy bandwidth. The 61-layer, 8-GPU line is a
PROJECTION from per-layer times measured here, not a measurement.

--refill W also decodes W x batch requests per case through the scheduler's continuous batching at batch slots
(refill_case: the server's engine loop without HTTP, prefills included), where a finished sequence's slot is taken
at once; the fixed batches above run until their slowest sequence ends.

--contexts C1,C2 times each case's captured rounds at C committed rows per sequence (run_context_case: short
prompts, then the lengths set to C) instead of decoding prompts.

--rank-of N (with --synth-k2) benches instead what one GPU of an N-GPU layout holds and computes: rank --rank's
shard of the synthetic target (numbaengine/rank_shard.py: made in GPU memory, no checkpoint files) and the drafter
at the published Kimi-K2.5-DFlash shape, replicated and/or split like the target (--drafter-layout; each ddtree or
dflash case runs once per layout). The rank runs alone: its all-reduces are stood in (--all-reduce none: local
work only; copy: one device copy of the same bytes), its vocabulary gathers copy its own slice; the JSON says which
(`rank_shard.stand_in`). Byte floors are the rank's. --allreduce-us adds the N-GPU ESTIMATE: the measured round plus
the collectives it stood in, each at that latency.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from numbaengine.budget import (
    AUTO,
    LADDER,
    Calibration,
    Coast,
    choose_rect,
    hindsight_stats,
    root_choice,
)
from numbaengine.kernels import cache as kernel_cache
from numbaengine.phases import record, span
from numbaengine.rank_shard import ALL_REDUCE_STAND_INS, set_drafter
from numbaengine.rounds import PREFILL_CHUNK
from numbaengine.tokenizer import IdTokenizer
from numbaengine.warmup import RoundLimit, precompile, precompile_shapes
from numbaengine.weights import SHIPPED_PAIR
from numbaengine.weights.synth import K25_DFLASH
from tools.acceptance import DEFAULT_PROMPTS, load_prompts
from tools.gpu import require_gpu

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = load_prompts(DEFAULT_PROMPTS, 8)      # held-out stdlib code the pair was not trained on
PHASES = ("draft", "build", "verify", "walk", "commit")


def copy_bandwidth(cp, nbytes=2 << 30, reps=10):
    """Device-to-device copy GB/s (bytes read + written)."""
    a, b = cp.empty(nbytes // 4, np.float32), cp.empty(nbytes // 4, np.float32)
    b[...] = a
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        b[...] = a
    e.record()
    e.synchronize()
    return 2 * nbytes * reps / (cp.cuda.get_elapsed_time(s, e) / 1e3) / 1e9


def _arrays(record):
    """The arrays of a weight record (dataclasses, lists, arrays), depth first."""
    if hasattr(record, "nbytes") and hasattr(record, "shape"):
        yield record
    elif isinstance(record, (list, tuple)):
        for r in record:
            yield from _arrays(r)
    elif dataclasses.is_dataclass(record):
        for f in dataclasses.fields(record):
            yield from _arrays(getattr(record, f.name))


def _address(a) -> int:
    """Start address of an array's memory (device arrays: their device pointer; NumPy: the host pointer)."""
    face = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(face["data"][0])


def nbytes(*records) -> int:
    """Distinct bytes of the arrays of weight records: memory covered by several arrays (a view, e.g. a drafter
    layer's `kv` rows inside its `qkv`) counts once. Arrays are taken as contiguous spans."""
    spans = sorted((_address(a), _address(a) + int(a.nbytes)) for r in records for a in _arrays(r) if a.nbytes)
    total, end = 0, None
    for lo, hi in spans:
        if end is None or lo >= end:
            total, end = total + hi - lo, hi
        elif hi > end:
            total, end = total + hi - end, hi
    return total


def round_floor(engine, dev, n_rows, mean_len) -> dict:
    """HBM bytes one round must move at least, by part."""
    cfg, w = engine.cfg, engine.target.w
    attn = sum(nbytes([a.q_kv_a, a.q_a_norm, a.q_b, a.kv_a_norm, a.w_uk, a.w_uv, a.o])
               for a in (layer.attn for layer in w.layers))
    dense = sum(nbytes(layer.mlp) for layer in w.layers if layer.mlp is not None)
    shared = sum(nbytes(layer.moe.shared) + nbytes(layer.moe.gate) for layer in w.layers if layer.moe is not None)
    experts = 0
    for layer in w.layers:
        if layer.moe is not None:     # each expert held (all E, or a shard's range) is touched with this chance
            k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
            experts += nbytes(layer.moe.experts) * (1 - (1 - k / E) ** n_rows)
    B = dev.shape.batch
    parts = {"attention": attn, "dense mlp": dense, "shared+router": shared, "experts (expected)": experts,
             "lm_head": nbytes(w.lm_head),
             "latent cache": cfg.num_hidden_layers * B * mean_len * cfg.latent_dim * 2}
    if dev.drafter is not None:
        d = dev.drafter
        parts["drafter"] = nbytes(d.layers) + nbytes(d.fc) + nbytes(w.lm_head)
        parts["drafter context"] = (2 * d.cfg.num_hidden_layers * B * mean_len * d.cfg.num_key_value_heads
                                    * d.cfg.head_dim * 4)
    return parts


def phase_floors(parts, dev) -> dict:
    """HBM bytes each phase of the round must move at least, from round_floor's parts: draft = the drafter's layers,
    lm_head and context rows; build = the draft logits (the top-K reads them); verify = the target's parts; walk =
    the verify logits (the sampler reads them); commit = fc and each drafter layer's k|v rows (the context rows of
    the committed tokens). A weight two phases read counts in both (the round's floor counts it once)."""
    out = dict.fromkeys(PHASES, 0)
    out["verify"] = sum(v for k, v in parts.items() if not k.startswith("drafter"))
    out["walk"] = nbytes(dev.logits)
    if dev.drafter is not None:
        d = dev.drafter
        out["draft"] = nbytes(d.layers) + nbytes(dev.target.w.lm_head) + parts["drafter context"]
        out["build"] = nbytes(dev.draft_logits)
        out["commit"] = nbytes(d.fc, [layer.kv for layer in d.layers])
    return out


def phase_times(cp, dev, reps=20) -> dict:
    """GPU milliseconds per phase of a round: the round captured as one graph per phase (the capture is cut at
    each mark), each replayed between events; lengths and bonus are restored after every replay."""
    s, graphs, cur = dev.stream, [], [None]
    saved = [a.copy() for a in (dev.lengths, dev.bonus)]

    def mark(phase):
        if cur[0] is not None:
            graphs.append((cur[0], s.end_capture()))
        cur[0] = phase
        s.begin_capture()
    with s:
        dev.round(mark)
        graphs.append((cur[0], s.end_capture()))
        acc = dict.fromkeys(PHASES, 0.0)
        for _ in range(reps):
            for phase, g in graphs:
                if phase not in acc:
                    continue
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(s)
                g.launch(s)
                b.record(s)
                b.synchronize()
                acc[phase] += cp.cuda.get_elapsed_time(a, b) / reps
            dev.lengths[...], dev.bonus[...] = saved
        s.synchronize()
    return acc


def run_case(engine, mode, budget, batch, new_tokens, copy_bw, cp, hold_s=0.0):
    """One (mode, budget, batch) row. The held-out PROMPTS are decoded in len(PROMPTS) // batch consecutive
    batches (at least one), so tau and tokens/s average over several prompts; synthetic checkpoints get random ids
    (their drafter is random: tau ~ 1). hold_s: the batches are decoded again (replaying the captured round) until
    that many seconds have passed, so that a profiler samples the decode long enough."""
    prompts = case_prompts(engine, batch)
    groups = [[prompts[(g * batch + j) % len(prompts)] for j in range(batch)]
              for g in range(max(1, len(prompts) // batch))]
    kw = dict(mode=mode, budget=budget, stop=[])
    engine.generate_batch(groups[0], 8, **kw)                                # compile, size buffers, capture
    dev = next(iter(engine.rounds_cache.values()))
    devs = getattr(dev, "devs", [dev])                                       # one DeviceRounds per GPU
    gpu0 = [d.gpu_s for d in devs]
    t0 = time.perf_counter()
    res, stats = [], []
    with span("decode"):
        while not res or time.perf_counter() - t0 < hold_s:
            for group in groups:
                out = engine.generate_batch(group, new_tokens, **kw)
                res += out
                stats.append(dict(out[0].stats, rounds=max(r.stats["rounds"] for r in out)))   # batch times, rounds
    wall = time.perf_counter() - t0
    rounds = sum(st["rounds"] for st in stats)
    round_ms = sum(st["phase_s"]["round"] for st in stats) / rounds * 1e3
    gpu_ms = sum(st["phase_s"]["gpu"] for st in stats) / rounds * 1e3
    decode_s = sum(st["decode_s"] for st in stats)
    new = sum(len(r.tokens) for r in res)
    record("decode", tokens=new)
    mean_len = int(np.mean([r.stats["prompt_tokens"] + len(r.tokens) / 2 for r in res]))
    row = dict(mode=mode, budget=budget, batch=batch, prompts=len(res), new_tokens=new, wall_s=wall,
               tokens_per_s=new / decode_s,
               tau=float(sum(r.stats["tau_mean"] * r.stats["rounds"] for r in res)
                         / max(1, sum(r.stats["rounds"] for r in res))),
               tau_prompt_mean=float(np.mean([r.stats["tau_mean"] for r in res])),
               **round_columns(engine, dev, rounds, round_ms, gpu_ms, mean_len, copy_bw, cp),
               gpu_ms_per_device=[(d.gpu_s - g) / rounds * 1e3 for d, g in zip(devs, gpu0)])
    if budget == AUTO:                 # the sizes chosen (rounds of every prompt) and the table they came from
        hist = collections.Counter()
        for r in res:
            hist.update({int(k): v for k, v in r.stats["budget_hist"].items()})
        row |= dict(budget_hist=dict(sorted(hist.items())), probes=sum(r.stats["probes"] for r in res),
                    cost_table=dev.table and dev.table.to_dict(), cost_table_from=getattr(dev, "table_from", "given"),
                    expected_tau=float(np.mean([r.stats["expected_tau"] for r in res])),
                    **weighed(res))
    print_row(row)
    if budget == AUTO:
        print_auto(row)
    return row


def case_prompts(engine, n) -> list:
    """The held-out prompts (text); synthetic checkpoints (random drafter: tau ~ 1) get n prompts of random ids."""
    if not isinstance(engine.tokenizer, IdTokenizer):
        return PROMPTS
    rng = np.random.default_rng(0)
    return [rng.integers(0, engine.cfg.vocab_size, 8 + 3 * (i % 5)).tolist() for i in range(n)]


def refill_case(engine, mode, budget, batch, new_tokens, waves) -> dict:
    """Continuous batching at `batch` slots (numbaengine.scheduler, the server's engine loop without HTTP): waves x
    batch requests of the case's prompts, each finished one's slot taken by the next waiting one, after one
    untimed wave of 8-token requests. Tokens/s from the first submit to the last finish, prefills included: what a
    server at concurrency `batch` decodes. run_case's fixed batch instead runs each batch until its slowest
    sequence ends, so its last rounds carry fewer sequences, the more so the more tau varies (trees)."""
    from numbaengine.generate import prompt_ids
    from numbaengine.scheduler import Request, Scheduler
    prompts = case_prompts(engine, batch)
    ids = [prompt_ids(p, engine.tokenizer, engine.cfg.vocab_size, engine.max_context) for p in prompts]
    sched = Scheduler(engine, max_batch=batch, max_queue=waves * batch + batch).start()
    try:
        def wave(n, tokens):
            done, results = threading.Semaphore(0), []

            def emit(update):
                if update.finish_reason is not None:
                    results.append(update)
                    done.release()
            for i in range(n):
                sched.submit(Request(ids[i % len(ids)], tokens, mode, budget, stop_ids=[], emit=emit, decode=False))
            for _ in range(n):
                while not done.acquire(timeout=1.0):
                    if not sched.thread.is_alive():
                        raise RuntimeError("refill: the scheduler's engine thread ended with requests unfinished")
            errors = [u.error for u in results if u.error is not None]
            if errors:
                raise RuntimeError(f"refill: {len(errors)} of {n} requests failed: {errors[0]}")
            return sum(u.tokens for u in results)
        wave(batch, 8)                                                       # slots, prefill pieces, captures
        t0 = time.perf_counter()
        tokens = wave(waves * batch, new_tokens)
        wall = time.perf_counter() - t0
    finally:
        sched.close()
    return dict(refill_requests=waves * batch, refill_tokens=tokens, refill_wall_s=wall,
                refill_tokens_per_s=tokens / wall)


def print_auto(row):
    """Budget auto's choices under its row: the sizes chosen, the probes, and per ladder size what the choices
    weighed (expected, calibrated) and what the probed trees would have accepted (hindsight)."""
    h = row["hindsight"]
    print(f"  auto: sizes {row['budget_hist']}, {row['probes']} probes; per size expected / calibrated "
          f"{row['expected_by_size']} / {row['calibrated_by_size']}; hindsight sizes {h['sizes']}: expected "
          f"{h['expected']}, accepted {h['accepted']} ({sum(h['trees'])} prefixes)", flush=True)


def weighed(res) -> dict:
    """Budget auto: what its choices weighed over a case's prompts (budget.Picks.stats), weighted by choices, and the
    calibration the last prompt ended with."""
    n = np.array([r.stats["choices_weighed"] for r in res], np.float64)
    out = {"choices_weighed": int(n.sum()), "calibration": res[-1].stats["calibration"]}
    for key in ("expected_by_size", "calibrated_by_size"):
        rows = [(k, r.stats[key]) for k, r in zip(n, res) if k and r.stats[key]]
        out[key] = ([round(float(x), 4) for x in np.average([v for _, v in rows], axis=0, weights=[k for k, _ in rows])]
                    if rows else [])
    seen = {}                                            # the probed trees in hindsight, over every prompt
    for r in res:
        h = r.stats["hindsight"]
        for k, n, e, a in zip(h["sizes"], h["trees"], h["expected"], h["accepted"]):
            row = seen.setdefault(k, [0, 0.0, 0.0])
            row[0], row[1], row[2] = row[0] + n, row[1] + n * e, row[2] + n * a
    out["hindsight"] = hindsight_stats(seen)
    return out


def round_columns(engine, dev, rounds, round_ms, gpu_ms, mean_len, copy_bw, cp) -> dict:
    """The columns of every case row: rounds, round and GPU ms, host share, the byte floor at mean_len committed
    rows per sequence (by part, GB/s, % of copy bandwidth), phase times and their floors, graph nodes and depth."""
    devs = getattr(dev, "devs", [dev])                                       # one DeviceRounds per GPU
    floor = round_floor(engine, dev, dev.shape.batch * (dev.tb.tokens.shape[1]), mean_len)
    floor_b = sum(floor.values())
    with span("phase_times"):
        phases = (dev.ranks.run(lambda r: phase_times(cp, devs[r]))[0] if len(devs) > 1
                  else phase_times(cp, devs[0]))
    phase_b = phase_floors(floor, dev)
    phase_pct = {k: 100 * phase_b[k] / (ms / 1e3) / 1e9 / copy_bw if ms > 0 else 0.0 for k, ms in phases.items()}
    return dict(rounds=rounds, round_ms=round_ms, gpu_ms=gpu_ms, host_pct=100 * (1 - gpu_ms / round_ms),
                mean_len=mean_len, floor_mb=floor_b / 1e6, floor_parts_mb={k: v / 1e6 for k, v in floor.items()},
                floor_gbs=floor_b / (gpu_ms / 1e3) / 1e9,
                floor_pct=100 * floor_b / (gpu_ms / 1e3) / 1e9 / copy_bw,
                phase_ms=phases, phase_floor_mb={k: v / 1e6 for k, v in phase_b.items()}, phase_pct=phase_pct,
                graph_kernels=len(dev.kernel_nodes()), graph_depth=dev.graph_depth())


def print_row(row):
    phases, pct, floors = row["phase_ms"], row["phase_pct"], row["phase_floor_mb"]
    where = f"p{row['prompts']:<4}" if "prompts" in row else f"c{row['context']:<5}"
    print(f"{row['mode']:7s} B{row['budget']!s:<4} x{row['batch']:<4d} {where} {row['tokens_per_s']:9.1f} tok/s  "
          f"tau {row['tau']:5.2f}  round {row['round_ms']:7.3f} ms  gpu {row['gpu_ms']:7.3f} ms  host "
          f"{row['host_pct']:5.1f}%  floor {row['floor_mb']:8.1f} MB = {row['floor_pct']:5.1f}% of copy  nodes "
          f"{row['graph_kernels']} depth {row['graph_depth']}  "
          + " ".join(f"{k} {v:.3f}" + (f" ({pct[k]:.0f}%)" if floors[k] else "") for k, v in phases.items()),
          flush=True)


def run_context_case(engine, mode, budget, batch, context, rounds, copy_bw, cp, hold_s=0.0):
    """One (mode, budget, batch) row at `context` committed rows per sequence: each slot prefills a short prompt,
    then its length is set to `context` (the rows past the prompt stay zero: attention reads them all the same, so
    the round costs what it costs at that context), and `rounds` captured rounds are replayed and timed (again from
    `context` until hold_s seconds have passed). tau is the synthetic pair's (~1)."""
    prompt = list(range(1, 9))
    kw = dict(mode=mode, budget=budget, stop=[])
    engine.generate_batch([prompt] * batch, 8, **kw)                         # compile, size buffers, capture
    dev = next(iter(engine.rounds_cache.values()))
    for b in range(batch):                                                   # slots live again, budgets set
        dev.prefill(b, prompt, b)
    taus, step_s, gpu0, t_end, sizes, state = [], 0.0, dev.gpu_s, time.perf_counter() + hold_s, [], (Coast(), None)
    with span("decode"):
        while not taus or time.perf_counter() < t_end:
            with dev.stream:                                                 # ordered before the rounds
                dev.lengths.fill(context)
            t1 = time.perf_counter()
            for _ in range(rounds):
                out, state = context_step(dev, sizes, *state)
                taus.append(out[:, 0].copy())
            step_s += time.perf_counter() - t1
    n, tau = len(taus), float(np.mean(taus))
    round_ms, gpu_ms = step_s / n * 1e3, (dev.gpu_s - gpu0) / n * 1e3
    row = dict(mode=mode, budget=budget, batch=batch, context=context, new_tokens=int(np.sum(taus)), wall_s=step_s,
               tokens_per_s=batch * tau / round_ms * 1e3, tau=tau,
               **round_columns(engine, dev, n, round_ms, gpu_ms, context + int(rounds * tau / 2), copy_bw, cp))
    if sizes:
        row["budget_hist"] = {s: sizes.count(s) for s in sorted(set(sizes))}
    print_row(row)
    return row


def context_step(dev, sizes, coast, chosen):
    """One round of the rounds `dev`; budget auto as DeviceSlots runs it: the size `chosen` from the last round's
    trees as one scored graph, or (none chosen) the probe and the choice from its trees; no probe while coasting
    (budget.Coast). Choices follow the rectangle rule with the rounds' measured table and no calibration (the
    synthetic drafter is random); each round's size is appended to sizes. Returns (out tokens, (coast, the next
    round's choice))."""
    if not dev.shape.ladder:
        return dev.step(), (coast, None)

    def choose(scores):
        return choose_rect(scores[:, 1:], np.full(len(scores), scores.shape[1]), dev.table, Calibration(),
                           len(scores))
    probed = None
    if coast.left:
        choice, out = root_choice(dev.bucket()), dev.step(0)
    elif chosen is not None:
        choice, out = chosen, dev.step(chosen.size, scored=chosen.size > 0)
    else:
        probed = dev.probe()
        choice = choose(probed)
        out = dev.step(choice.size)
    sizes.append(choice.size)
    coast = coast.after(choice)
    if not choice.probed or coast.left:
        return out, (coast, None)
    return out, (coast, choose(probed if probed is not None else dev.scores()))


def prefill_times(engine, tokens, cp, reps=3) -> dict:
    """Milliseconds of one eager prompt forward of `tokens` random ids (batch 1, fresh cache, all layers, lm_head
    included) in each MLA form; the engine prefills in engine.target.ops.prefill_form."""
    if engine.ranks is not None:
        return {}
    target = engine.target
    ids = np.random.default_rng(0).integers(0, engine.cfg.vocab_size, tokens).astype(np.int32)
    out = {}
    for form in ("naive", "absorbed"):
        cache = target.new_cache(tokens)
        ms = []
        for _ in range(reps + 1):                 # the first call compiles; forward does not commit rows
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            target.forward(ids, np.arange(tokens, dtype=np.int32), cache, form=form)
            cp.cuda.Device().synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        out[f"{form}_ms"] = min(ms[1:])
    out["graphs_ms"] = graph_prefill_ms(engine, ids, cp, reps)
    print(f"prefill {tokens} tokens: naive {out['naive_ms']:.1f} ms, absorbed {out['absorbed_ms']:.1f} ms, "
          f"engine (pieces of {PREFILL_CHUNK} as prefill graphs, first token sampled) {out['graphs_ms']:.2f} ms "
          f"(engine form: {target.ops.prefill_form})", flush=True)
    return dict(tokens=tokens, engine_form=target.ops.prefill_form, **out)


def graph_prefill_ms(engine, ids, cp, reps=3) -> float:
    """Milliseconds from the prompt to its first token on the host as the engine prefills (DeviceRounds.prefill in
    pieces of PREFILL_CHUNK, each a captured graph on the staging slot, then the sample): best of reps after two
    warm-up prompts (eager, capture)."""
    from numbaengine.device_round import DeviceRounds, Shape
    dev = DeviceRounds(engine.target, engine.drafter, Shape(1, "ddtree", 16, len(ids) + 1))
    ms = []
    for _ in range(reps + 2):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for start in range(0, len(ids), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(ids))
            if end < len(ids):
                dev.prefill_part(0, ids, start, end)
            else:
                dev.prefill(0, ids, 0, start=start)             # the last piece; reads the first token
        ms.append((time.perf_counter() - t0) * 1e3)
    return min(ms[2:])


def synth_k2(layers: int, where: Path):
    """A K2.6-shaped target (full width, `layers` layers: one dense, the rest MoE with 384 random INT4 experts)
    and a 1-layer DFlash drafter for it, written to `where`, or the pair already there when it has that many layers
    (`--synth-dir`: a second run in the same device call skips the ~40 s of writing)."""
    from numbaengine.weights.synth import synth_config, write_draft, write_target
    done = where / "complete"
    if done.exists() and done.read_text() == str(layers):
        print(f"synthetic K2.6-shaped checkpoint ({layers} layers) reused from {where}", flush=True)
        return where / "target", where / "draft"
    done.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with span("checkpoint"):
        write_target(where / "target", synth_config("k2", layers=layers, quant="int4"), seed=0)
        write_draft(where / "draft", where / "target", layers=1, block_size=16, seed=1)
    done.write_text(str(layers))                       # last: a half-written pair is never reused
    print(f"synthetic K2.6-shaped checkpoint ({layers} layers) written in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return where / "target", where / "draft"


def projection(rows, layers_measured, cfg) -> list:
    """61 layers on 8 GPUs, from a measured round: MoE-layer time scaled to 60 MoE layers with experts split 8
    ways (expert bytes / 8) and attention heads split 8 ways, plus the measured non-layer time. A PROJECTION."""
    out = []
    for r in rows:
        parts = r["floor_parts_mb"]
        layer_mb = (parts["attention"] + parts["shared+router"] + parts["experts (expected)"] + parts["latent cache"]
                    ) / max(layers_measured, 1)
        per_gpu_mb = layer_mb * 61 / 8 + (parts["lm_head"] + parts.get("drafter", 0)) / 8
        eff = r["floor_pct"] / 100
        ms = per_gpu_mb / 1e3 / (eff * r["copy_gbs"]) * 1e3 if eff > 0 else float("nan")
        out.append(dict(mode=r["mode"], budget=r["budget"], batch=r["batch"], per_gpu_floor_mb=per_gpu_mb,
                        projected_round_ms=ms, projected_tokens_per_s=r["batch"] * r["tau"] / ms * 1e3,
                        note="projection: measured efficiency applied to the 61-layer 8-GPU byte floor; "
                             "all-reduce time not included"))
    return out


# ------------------------------------------------------------------------- one rank of several GPUs (--rank-of)
PUBLISHED_TAU = 5.3      # Kimi-K2.5-DFlash's published acceptance at block 8 on coding (spec/DDTREE.md section 5)
LAYOUTS = ("replicated", "split")


def add_rank_args(ap, layouts):
    """The --rank-of options (tools.bench, tools.profile_round; check_rank_args reads them); layouts: the default
    drafter layouts, one or both comma-separated."""
    ap.add_argument("--rank-of", type=int, metavar="N", help="with --synth-k2: the shard one GPU of an N-GPU layout "
                    "holds, made in GPU memory, its collectives stood in (see tools/bench.py's docstring)")
    ap.add_argument("--rank", type=int, default=0, help="with --rank-of: which rank's shard (default 0)")
    ap.add_argument("--drafter-layout", default=layouts, help="with --rank-of: the drafter replicated, split like the "
                    f"target{', or both in turn' if ',' in layouts else ''} (default {layouts})")
    ap.add_argument("--all-reduce", choices=ALL_REDUCE_STAND_INS, default="none",
                    help="with --rank-of: the all-reduce stand-in (none: local work only; copy: a copy of its bytes)")
    ap.add_argument("--seed", type=int, default=0, help="with --rank-of: the synthetic weights' seed")


def check_rank_args(args) -> list:
    """The drafter layouts to run ([None] without --rank-of); a one-line ValueError for arguments that do not fit
    together or a layout the model cannot take."""
    if args.rank_of is None:
        return [None]
    if not args.synth_k2:
        raise ValueError("--rank-of needs --synth-k2 LAYERS (the shard is made of the synthetic K2.6 model)")
    if args.devices or args.synth_dir:
        raise ValueError("--rank-of makes its shard in GPU memory on one GPU: drop --devices and --synth-dir")
    from numbaengine.config import load_config
    from numbaengine.drafter import parse_draft_config
    from numbaengine.parallel import check_divisible, check_rank
    from numbaengine.rank_shard import local_draft_config
    from numbaengine.weights.synth import k25_dflash_config, synth_config
    check_rank(args.rank, args.rank_of)
    raw = synth_config("k2", layers=args.synth_k2, quant="int4")
    check_divisible(load_config(raw), args.rank_of)
    layouts = args.drafter_layout.split(",")
    if not layouts or any(lay not in LAYOUTS for lay in layouts):
        raise ValueError(f"--drafter-layout: {args.drafter_layout!r} is not a list of {', '.join(LAYOUTS)}")
    if "split" in layouts:
        local_draft_config(parse_draft_config(k25_dflash_config(raw)), args.rank_of)
    return layouts


def rank_setup(args, cases, layouts, max_context, cp):
    """The memory plan checked against the free GPU memory (MemoryError, one line), then rank --rank of --rank-of's
    shard made on the GPU -> (RankEngine, drafter config dict, plan)."""
    from numbaengine.config import load_config
    from numbaengine.rank_shard import check_fits, memory_plan, rank_engine
    from numbaengine.weights.synth import k25_dflash_config, synth_config
    raw = synth_config("k2", layers=args.synth_k2, quant="int4")
    cfg, draft_cfg = load_config(raw), k25_dflash_config(raw)
    plan = memory_plan(cfg, draft_cfg, args.rank, args.rank_of, [lay == "split" for lay in layouts], cases,
                       max_context)
    cp.get_default_memory_pool().free_all_blocks()
    check_fits(plan, cp.cuda.runtime.memGetInfo()[0],
               f"rank {args.rank} of {args.rank_of} ({args.synth_k2} layers, context {max_context})")
    with span("shard"):
        shard = rank_engine(cfg, args.seed, args.rank, args.rank_of, "cuda", max_context, args.all_reduce)
    print(f"rank {args.rank} of {args.rank_of}: {nbytes(shard.engine.target.w) / 1e9:.1f} GB of target weights made "
          f"on the GPU; {shard.comm.describe()}", flush=True)
    return shard, draft_cfg, plan


def precompile_cases(engine, cases):
    """precompile_shapes, with token-id prompts for a model without a tokenizer (its PROMPT is text)."""
    if not isinstance(engine.tokenizer, IdTokenizer):
        return precompile_shapes(engine, cases)

    def dry_run():
        for mode, batch, budget in cases:
            try:
                engine.generate_batch([list(range(1, 17))] * batch, 16, mode, budget, stop=(), on_round=RoundLimit(3))
            except Exception:  # garbage results of a dry run (or the round limit); the next shape still records
                pass
    done = precompile(dry_run)
    engine.rounds_cache.clear()
    return done


def check_eager(engine, cases, new_tokens=16) -> list:
    """For each (mode, budget) of `cases` at its smallest batch: do captured rounds commit the tokens of eager
    rounds (greedy)? -> [{mode, budget, batch, same}]."""
    out, prompt = [], list(range(1, 9))
    for mode, budget in dict.fromkeys((m, b) for m, _, b in cases):
        if budget == AUTO:
            continue
        batch = min(b for m, b, bud in cases if (m, bud) == (mode, budget))
        runs = []
        for graphs in (True, False):
            engine.rounds_cache.clear()
            res = engine.generate_batch([prompt] * batch, new_tokens, mode, budget, stop=[], graphs=graphs)
            runs.append([r.tokens for r in res])
        engine.rounds_cache.clear()
        out.append(dict(mode=mode, budget=budget, batch=batch, same=runs[0] == runs[1]))
        print(f"graph replay == eager: {mode} B{budget} x{batch}: {runs[0] == runs[1]}", flush=True)
    return out


def collectives(mode, layers, draft_layers, split) -> int:
    """Collectives per round on each GPU: 2 all-reduces per target layer and the verify logits' vocabulary gather;
    drafted modes add the draft logits' gather and, split, 2 all-reduces per drafter layer."""
    n = 2 * layers + 1
    if mode != "ar":
        n += 1 + (2 * draft_layers if split else 0)
    return n


def estimate(rows, layers, draft_layers, us, source, n_gpus) -> list:
    """The n-GPU ESTIMATE of each measured rank row: its round time plus collectives() x `us` microseconds;
    tokens/s at the measured tau and, for drafted modes, at PUBLISHED_TAU."""
    out = []
    for r in rows:
        c = collectives(r["mode"], layers, draft_layers, r.get("drafter_layout") == "split")
        ms = r["round_ms"] + c * us / 1e3
        taus = {"measured tau": r["tau"]} if r["mode"] != "ar" else {"ar": 1.0}
        if r["mode"] != "ar":
            taus[f"published tau {PUBLISHED_TAU}"] = PUBLISHED_TAU
        out.append(dict(mode=r["mode"], budget=r["budget"], batch=r["batch"], context=r.get("context"),
                        drafter_layout=r.get("drafter_layout"), collectives=c, round_ms=ms,
                        tokens_per_s={k: r["batch"] * t / ms * 1e3 for k, t in taus.items()},
                        note=f"ESTIMATE for {n_gpus} GPUs: one rank's round measured alone + {c} collectives x "
                             f"{us} us ({source})"))
    return out


def budget_list(text) -> list:
    """--budgets: comma-separated integers and 'auto' (the size chosen each round; numbaengine/budget.py)."""
    return [AUTO if b.strip() == AUTO else int(b) for b in text.split(",")]


def verify_rows(batch, budget) -> int:
    """Verify rows of a round: batch x (budget + 1); auto at most the largest ladder size."""
    return batch * ((max(LADDER) if budget == AUTO else budget) + 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_PAIR / "target"))
    ap.add_argument("--draft", default=str(SHIPPED_PAIR / "draft"))
    ap.add_argument("--synth-k2", type=int, metavar="LAYERS", help="bench a K2.6-shaped checkpoint made here")
    ap.add_argument("--synth-dir", help="with --synth-k2: write the checkpoint to this folder and keep it; a later run "
                                        "with the same folder and layer count reuses it")
    ap.add_argument("--modes", default="ar,dflash,ddtree")
    ap.add_argument("--budgets", type=budget_list, default="4,16,64,256", help="ddtree budgets; 'auto' picks "
                    "each round's tree size from a measured cost table (default: 4,16,64,256)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hold-seconds", type=float, default=0.0, metavar="S",
                    help="repeat each case's timed decode until S seconds have passed (for numbaengine.profile)")
    ap.add_argument("--refill", type=int, default=0, metavar="WAVES", help="also decode WAVES x batch requests per "
                    "case through the scheduler's continuous batching at batch slots (refill_case)")
    ap.add_argument("--max-rows", type=int, default=1200, help="skip cases with batch * (budget + 1) above this")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=0, metavar="TOKENS", help="also time a prompt forward this long")
    ap.add_argument("--devices", help="comma-separated GPU ids: one rank per GPU over NCCL (default: GPU 0 alone)")
    ap.add_argument("--contexts", help="comma-separated committed rows per sequence: time each case's rounds at each "
                    "context (run_context_case) instead of decoding prompts")
    ap.add_argument("--context-rounds", type=int, default=32, help="with --contexts: rounds timed per case")
    add_rank_args(ap, "replicated,split")
    ap.add_argument("--check-eager", action="store_true", help="also decode each (mode, budget) at the smallest "
                    "batch eagerly and record whether the graph replays give the same tokens")
    ap.add_argument("--allreduce-us", type=float, help="with --rank-of: add the N-GPU ESTIMATE, the measured round "
                    "plus every stood-in collective at this latency (microseconds)")
    ap.add_argument("--allreduce-source", default="not stated", help="where --allreduce-us comes from (written into "
                    "each ESTIMATE note). For 8 H200s over NVLink use NCCL in a CUDA graph, 8 GPUs, from "
                    "github.com/sgl-project/sglang/pull/22734: 20 us for 1-token rounds (32 KiB: 19.63 us), 21 us "
                    "for 17-row rounds (512 KiB: 20.86 us); none found at 15.6 MB (batch 32 x 17 rows): >= 60 us, "
                    "a lower bound from the ~275 GB/s peak algbw (docs/PERFORMANCE.md, '8-GPU estimate')")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false", help="read each round's tokens before "
                    "launching the next (default: the next round is launched first, Engine.overlap)")
    ap.add_argument("--no-precompile", action="store_true", help="compile kernels as the cases meet them instead of "
                    "in parallel workers first (default: precompile what the kernel cache lacks)")
    ap.add_argument("--out", default="bench.json")
    args = ap.parse_args(argv)
    try:
        layouts = check_rank_args(args)
    except ValueError as e:
        ap.exit(2, f"bench: {e}\n")
    require_gpu("python -m tools.bench")
    t_main = time.perf_counter()         # first_case_done_s: from here to the end of the first timed case
    import cupy as cp

    from numbaengine import Engine
    copy_bw = copy_bandwidth(cp)
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    asked = [(mode, batch, budget) for mode in args.modes.split(",")
             for budget in (args.budgets if mode == "ddtree" else [0])
             for batch in [int(b) for b in args.batches.split(",")]]
    cases = [c for c in asked if verify_rows(c[1], c[2]) <= args.max_rows]
    for mode, batch, budget in (c for c in asked if c not in cases):
        print(f"skipped {mode} budget {budget} batch {batch}: {verify_rows(batch, budget)} verify rows > --max-rows "
              f"{args.max_rows}", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [None]
    max_context = args.max_context if not args.contexts else max(args.max_context,   # room for the timed rounds
                                                                  max(contexts) + 16 * args.context_rounds + 64)
    t0, devices, shard, tmp = time.perf_counter(), None, None, None
    if args.rank_of:
        try:
            shard, draft_cfg, plan = rank_setup(args, cases, layouts, max_context, cp)
        except MemoryError as e:
            ap.exit(2, f"bench: {e}\n")
        engine = shard.engine
    else:
        model, draft = Path(args.model), Path(args.draft)
        if args.synth_k2:
            if args.synth_dir:
                Path(args.synth_dir).mkdir(parents=True, exist_ok=True)
            else:
                tmp = tempfile.TemporaryDirectory(prefix="k2_")
            model, draft = synth_k2(args.synth_k2, Path(args.synth_dir or tmp.name))
        devices = [int(d) for d in args.devices.split(",")] if args.devices else None
        engine = Engine.load(model, draft, backend="cuda", max_context=max_context, devices=devices)
    engine.overlap = args.overlap
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rows, checks, first_round_s = [], [], None
    for i, layout in enumerate(layouts):
        todo = [c for c in cases if i == 0 or c[0] != "ar"]             # ar (no drafter): with the first layout
        if not todo:
            continue
        if layout is not None and any(c[0] != "ar" for c in todo):
            set_drafter(shard, draft_cfg, layout == "split")
            print(f"drafter {layout}: {nbytes(engine.drafter.layers, engine.drafter.fc) / 1e9:.2f} GB", flush=True)
        if not args.no_precompile:
            done = precompile_cases(engine, [c for c in todo if c[2] != "auto"])
            print(f"precompiled {done.compiled} of {done.found} missing kernels in {done.seconds:.1f} s", flush=True)
        if args.check_eager:
            checks += [dict(c, drafter_layout=layout) for c in check_eager(engine, todo)]
        for (mode, batch, budget), context in ((c, x) for c in todo for x in contexts):
            try:
                row = (run_case(engine, mode, budget, batch, args.new_tokens, copy_bw, cp, args.hold_seconds)
                       if context is None else
                       run_context_case(engine, mode, budget, batch, context, args.context_rounds, copy_bw, cp,
                                        args.hold_seconds))
            except (MemoryError, NotImplementedError) as e:
                print(f"{mode} {budget} x{batch}: {e}", flush=True)
                continue
            if args.refill and context is None:
                row |= refill_case(engine, mode, budget, batch, args.new_tokens, args.refill)
                print(f"  refill: {row['refill_tokens_per_s']:.1f} tok/s, {row['refill_requests']} requests "
                      f"through {batch} slots (continuous batching, prefills included)", flush=True)
            first_round_s = first_round_s or round(time.perf_counter() - t_main, 3)
            row["copy_gbs"] = copy_bw
            if layout is not None and mode != "ar":
                row["drafter_layout"] = layout
            rows.append(row)
    prefill = prefill_times(engine, args.prefill, cp) if args.prefill else {}
    name = f"synthetic K2.6 x{args.synth_k2}" if args.synth_k2 else str(args.model)
    result = dict(copy_gbs=copy_bw, prefill=prefill, model=name, first_case_done_s=first_round_s,
                  kernels=kernel_cache.stats(), eager_checks=checks,
                  layers=engine.cfg.num_hidden_layers, rows=rows, date=time.strftime("%Y-%m-%d"), devices=devices,
                  overlap=args.overlap,
                  gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    if shard is not None:
        result["model"] = f"{name}, rank {shard.rank} of {shard.of}"
        result["rank_shard"] = dict(rank=shard.rank, of=shard.of, seed=shard.seed, stand_in=shard.comm.describe(),
                                    target_gb=nbytes(engine.target.w) / 1e9, drafter=K25_DFLASH,
                                    memory_plan_gb={k: v / 1e9 for k, v in plan.items()},
                                    note=f"MEASURED: one GPU's share of the {shard.of}-GPU layout run alone; its "
                                         "collectives are stood in, so the time excludes the all-reduces")
        if args.allreduce_us is not None:
            result["estimate_n_gpus"] = estimate(rows, engine.cfg.num_hidden_layers, K25_DFLASH["layers"],
                                                 args.allreduce_us, args.allreduce_source, shard.of)
            for e in result["estimate_n_gpus"]:
                print("ESTIMATE", e, flush=True)
    elif args.synth_k2:
        result["projection_61_layers_8_gpus"] = projection(rows, engine.cfg.num_hidden_layers, engine.cfg)
        for p in result["projection_61_layers_8_gpus"]:
            print("PROJECTION", p, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"new_tokens": sum(r["new_tokens"] for r in rows)}))
    return result


if __name__ == "__main__":
    main()
