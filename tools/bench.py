"""End-to-end decoding benchmark on the cuda backend: tokens/s, tau, round time split into GPU and host, time per
phase, and each round's HBM byte floor against the copy bandwidth measured in the same run. JSON + a table.

    python -m tools.bench --out bench.json                              (the shipped pair)
    python -m tools.bench --synth-k2 2 --modes ar,ddtree --budgets 16   (a K2.6-shaped checkpoint made here)
    python -m numbaengine.profile --out DIR -- python -m tools.bench --synth-k2 2 --modes ar --hold-seconds 10

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
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from numbaengine.budget import AUTO, LADDER
from numbaengine.kernels import cache as kernel_cache
from numbaengine.phases import record, span
from numbaengine.tokenizer import IdTokenizer
from numbaengine.warmup import precompile_shapes
from numbaengine.weights import SHIPPED_PAIR
from tools.acceptance import DEFAULT_PROMPTS, load_prompts

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
        if layer.moe is not None:
            e = layer.moe.experts
            per_expert = nbytes(e) / cfg.n_routed_experts
            k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
            experts += per_expert * E * (1 - (1 - k / E) ** n_rows)
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
    prompts = PROMPTS
    if isinstance(engine.tokenizer, IdTokenizer):                            # synthetic checkpoints: token ids
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, engine.cfg.vocab_size, 8 + 3 * (i % 5)).tolist() for i in range(batch)]
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
    floor = round_floor(engine, dev, batch * (dev.tb.tokens.shape[1]), mean_len)
    floor_b = sum(floor.values())
    with span("phase_times"):
        phases = (dev.ranks.run(lambda r: phase_times(cp, devs[r]))[0] if len(devs) > 1
                  else phase_times(cp, devs[0]))
    phase_b = phase_floors(floor, dev)
    phase_pct = {k: 100 * phase_b[k] / (ms / 1e3) / 1e9 / copy_bw if ms > 0 else 0.0 for k, ms in phases.items()}
    row = dict(mode=mode, budget=budget, batch=batch, prompts=len(res), new_tokens=new, wall_s=wall,
               tokens_per_s=new / decode_s,
               tau=float(sum(r.stats["tau_mean"] * r.stats["rounds"] for r in res)
                         / max(1, sum(r.stats["rounds"] for r in res))),
               tau_prompt_mean=float(np.mean([r.stats["tau_mean"] for r in res])),
               rounds=rounds, round_ms=round_ms, gpu_ms=gpu_ms, host_pct=100 * (1 - gpu_ms / round_ms),
               floor_mb=floor_b / 1e6, floor_parts_mb={k: v / 1e6 for k, v in floor.items()},
               floor_gbs=floor_b / (gpu_ms / 1e3) / 1e9,
               floor_pct=100 * floor_b / (gpu_ms / 1e3) / 1e9 / copy_bw,
               phase_ms=phases, phase_floor_mb={k: v / 1e6 for k, v in phase_b.items()}, phase_pct=phase_pct,
               graph_kernels=len(dev.kernel_nodes()), graph_depth=dev.graph_depth(),
               gpu_ms_per_device=[(d.gpu_s - g) / rounds * 1e3 for d, g in zip(devs, gpu0)])
    print(f"{mode:7s} B{budget!s:<4} x{batch:<4d} p{len(res):<4d} {row['tokens_per_s']:9.1f} tok/s  "
          f"tau {row['tau']:5.2f}  round {round_ms:7.3f} ms  gpu {gpu_ms:7.3f} ms  host {row['host_pct']:5.1f}%  floor "
          f"{row['floor_mb']:8.1f} MB = {row['floor_pct']:5.1f}% of copy  nodes {row['graph_kernels']} "
          f"depth {row['graph_depth']}  " + " ".join(f"{k} {v:.3f}" + (f" ({phase_pct[k]:.0f}%)" if phase_b[k] else "")
                                                     for k, v in phases.items()), flush=True)
    return row


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
    print(f"prefill {tokens} tokens: naive {out['naive_ms']:.1f} ms, absorbed {out['absorbed_ms']:.1f} ms "
          f"(engine: {target.ops.prefill_form})", flush=True)
    return dict(tokens=tokens, engine_form=target.ops.prefill_form, **out)


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
    ap.add_argument("--budgets", type=budget_list, default="4,16,64,256", help="ddtree budgets; 'auto' is "
                    "refused on cuda with the line saying what it lacks (default: 4,16,64,256)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hold-seconds", type=float, default=0.0, metavar="S",
                    help="repeat each case's timed decode until S seconds have passed (for numbaengine.profile)")
    ap.add_argument("--max-rows", type=int, default=1200, help="skip cases with batch * (budget + 1) above this")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=0, metavar="TOKENS", help="also time a prompt forward this long")
    ap.add_argument("--devices", help="comma-separated GPU ids: one rank per GPU over NCCL (default: GPU 0 alone)")
    ap.add_argument("--no-precompile", action="store_true", help="compile kernels as the cases meet them instead of "
                    "in parallel workers first (default: precompile what the kernel cache lacks)")
    ap.add_argument("--out", default="bench.json")
    args = ap.parse_args(argv)
    t_main = time.perf_counter()         # first_case_done_s: from here to the end of the first timed case
    import cupy as cp

    from numbaengine import Engine
    copy_bw = copy_bandwidth(cp)
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    model, draft = Path(args.model), Path(args.draft)
    tmp = None
    if args.synth_k2:
        if args.synth_dir:
            Path(args.synth_dir).mkdir(parents=True, exist_ok=True)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="k2_")
        model, draft = synth_k2(args.synth_k2, Path(args.synth_dir or tmp.name))
    t0 = time.perf_counter()
    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    engine = Engine.load(model, draft, backend="cuda", max_context=args.max_context, devices=devices)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    cases = [(mode, batch, budget) for mode in args.modes.split(",")
             for budget in (args.budgets if mode == "ddtree" else [0])
             for batch in [int(b) for b in args.batches.split(",")] if verify_rows(batch, budget) <= args.max_rows]
    if not args.no_precompile:
        done = precompile_shapes(engine, [c for c in cases if c[2] != "auto"])
        print(f"precompiled {done.compiled} of {done.found} missing kernels in {done.seconds:.1f} s", flush=True)
    rows, first_round_s = [], None
    for mode, batch, budget in cases:
        try:
            row = run_case(engine, mode, budget, batch, args.new_tokens, copy_bw, cp, args.hold_seconds)
        except (MemoryError, NotImplementedError) as e:
            print(f"{mode} {budget} x{batch}: {e}", flush=True)
            continue
        first_round_s = first_round_s or round(time.perf_counter() - t_main, 3)
        row["copy_gbs"] = copy_bw
        rows.append(row)
    prefill = prefill_times(engine, args.prefill, cp) if args.prefill else {}
    name = f"synthetic K2.6 x{args.synth_k2}" if args.synth_k2 else str(args.model)
    result = dict(copy_gbs=copy_bw, prefill=prefill, model=name, first_case_done_s=first_round_s,
                  kernels=kernel_cache.stats(),
                  layers=engine.cfg.num_hidden_layers, rows=rows, date=time.strftime("%Y-%m-%d"), devices=devices,
                  gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    if args.synth_k2:
        result["projection_61_layers_8_gpus"] = projection(rows, engine.cfg.num_hidden_layers, engine.cfg)
        for p in result["projection_61_layers_8_gpus"]:
            print("PROJECTION", p, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"new_tokens": sum(r["new_tokens"] for r in rows)}))
    return result


if __name__ == "__main__":
    main()
