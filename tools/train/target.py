"""Target phase: corpus windows, held-out bits per byte, training with aux-loss-free router balancing, INT4
(round-to-nearest vs QAT), export, then INT4 baked in and frozen for the drafter phase."""
from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools.train.export import export_target
from tools.train.model import Target, fake_int4, init_target
from tools.train.plan import Clock, Plan, autocast, log, lr_at

# ---------------------------------------------------------------- data

def load_data(path: Path, device) -> dict:
    d = {k: np.load(path / f"{k}.npy") for k in ("train", "heldout", "def_ends", "token_bytes", "starts_nl")}
    out = {k: torch.from_numpy(d[k].astype(np.int64)).to(device) for k in ("train", "heldout", "def_ends")}
    out["token_bytes"] = torch.from_numpy(d["token_bytes"].astype(np.float64)).to(device)
    out["nl_ends"] = torch.from_numpy(np.nonzero(d["starts_nl"][d["train"]])[0]).to(device)
    out["held_nl_ends"] = torch.from_numpy(np.nonzero(d["starts_nl"][d["heldout"]])[0]).to(device)
    return out


def windows(stream, starts, length):
    """stream[starts[i] : starts[i] + length] for each i -> [n, length]."""
    return stream[starts[:, None] + torch.arange(length, device=stream.device)]


def sample_windows(stream, n, length, gen):
    starts = torch.randint(0, len(stream) - length, (n,), device=stream.device, generator=gen)
    return windows(stream, starts, length)


# ---------------------------------------------------------------- evaluation

def quantized_copy(model: Target, int4: bool) -> Target:
    """The model as the engine sees it: weights rounded to bf16, routed experts INT4-dequantized if int4."""
    m = copy.deepcopy(model).float().eval()
    for moe in m.moe_layers():
        moe.frozen = None
    with torch.no_grad():
        for name, p in m.named_parameters():
            if int4 and name.rsplit(".", 1)[-1].startswith("experts_"):
                p.copy_(fake_int4(p))
            else:
                p.copy_(p.bfloat16().float())
    return m


@torch.no_grad()
def bits_per_byte(model: Target, data: dict, plan: Plan, int4: bool, batch=32) -> float:
    """Held-out bits per byte over non-overlapping windows (every token after a window's first), fp32 math."""
    m = quantized_copy(model, int4)
    stream, seq = data["heldout"], plan.seq
    n = min((len(stream) - 1) // seq, plan.eval_windows)
    starts = torch.arange(n, device=stream.device) * seq
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    nats, nbytes = 0.0, 0.0
    for i in range(0, n, batch):
        w = windows(stream, starts[i:i + batch], seq)
        logits = m(w[:, :-1])[0].float()
        nats += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        nbytes += data["token_bytes"][w[:, 1:]].sum().item()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return nats / math.log(2) / nbytes


# ---------------------------------------------------------------- training

@torch.no_grad()
def heldout_loss(model: Target, data: dict, plan: Plan, device, n=32) -> float:
    """Quick held-out CE (nats/token) on the first n windows, training precision."""
    was = model.training
    model.eval()
    w = windows(data["heldout"], torch.arange(n, device=device) * plan.seq, plan.seq + 1)
    with autocast(device):
        logits = model(w[:, :-1])[0]
    model.train(was)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()


def train_target(model: Target, data: dict, plan: Plan, device, seconds, steps=None, lr=None, fake_quant=False,
                 seed=0) -> dict:
    """AdamW on random corpus windows; aux-loss-free router bias updates after every step."""
    for m in model.moe_layers():
        m.fake_quant = fake_quant
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    cap = plan.max_epochs * len(data["train"]) / (plan.batch * plan.seq) if lr is None else math.inf
    clock, last, tokens = Clock(seconds, steps, cap), time.time(), 0
    model.train()
    while not clock.done():
        peak = lr if lr is not None else plan.lr
        for g in opt.param_groups:
            g["lr"] = peak if lr is not None else lr_at(clock.frac(), peak)
        w = sample_windows(data["train"], plan.batch, plan.seq + 1, gen)
        with autocast(device):
            logits = model(w[:, :-1])[0]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_router_bias(model)
        clock.step += 1
        tokens += w[:, 1:].numel()
        if time.time() - last > 10 or clock.done():
            last = time.time()
            log(f"target{' qat' if fake_quant else ''} step {clock.step} loss {loss.item():.4f} "
                f"held-out {heldout_loss(model, data, plan, device):.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"tokens {tokens} {clock.elapsed():.0f}s")
    for m in model.moe_layers():
        m.fake_quant = False
    return dict(steps=clock.step, tokens=tokens, seconds=round(clock.elapsed(), 1), final_loss=loss.item())


@torch.no_grad()
def update_router_bias(model: Target, rate=1e-3) -> None:
    """DeepSeek-V3 aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    for m in model.moe_layers():
        load = m.load.float()
        m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def bake_int4(model: Target, device) -> None:
    """Replace expert weights by their INT4 dequantized values (the shipped target) and freeze the target."""
    with torch.no_grad():
        for m in model.moe_layers():
            for p in (m.experts_gate, m.experts_up, m.experts_down):
                p.copy_(fake_int4(p))
    freeze(model, device)


def freeze(model: Target, device) -> None:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.moe_layers():
        m.freeze(torch.bfloat16 if device.type == "cuda" else torch.float32)


def train_and_export_target(plan: Plan, data: dict, device, out: Path, metrics: dict, args) -> Target:
    """Target phase: train, measure bits per byte (bf16, INT4 round-to-nearest, INT4 after QAT), export the
    better INT4 version, then bake INT4 into the weights and freeze."""
    model = Target(plan.target)
    init_target(model, args.seed)
    model.to(device)
    metrics["target_params"] = sum(p.numel() for p in model.parameters())
    metrics["target_train"] = train_target(model, data, plan, device, plan.target_seconds, args.target_steps)
    metrics["bpb_bf16"] = bits_per_byte(model, data, plan, int4=False)
    metrics["bpb_int4_rtn"] = bits_per_byte(model, data, plan, int4=True)
    log(f"held-out bits/byte: bf16 {metrics['bpb_bf16']:.4f}  int4 round-to-nearest {metrics['bpb_int4_rtn']:.4f}")
    pre_qat = copy.deepcopy(model.state_dict())
    metrics["qat_train"] = train_target(model, data, plan, device, plan.qat_seconds, args.qat_steps,
                                        lr=plan.lr * 0.1, fake_quant=True, seed=args.seed + 7)
    metrics["bpb_int4_qat"] = bits_per_byte(model, data, plan, int4=True)
    metrics["bpb_bf16_after_qat"] = bits_per_byte(model, data, plan, int4=False)
    metrics["int4_choice"] = "qat" if metrics["bpb_int4_qat"] <= metrics["bpb_int4_rtn"] else "rtn"
    if metrics["int4_choice"] == "rtn":
        model.load_state_dict(pre_qat)
    metrics["bpb_int4"] = metrics[f"bpb_int4_{metrics['int4_choice']}"]
    metrics["int4_cost_pct"] = 100 * (metrics["bpb_int4"] / metrics["bpb_bf16"] - 1)
    log(f"int4 after qat {metrics['bpb_int4_qat']:.4f} -> ship {metrics['int4_choice']}: "
        f"{metrics['int4_cost_pct']:+.2f}% vs bf16")
    export_target(model, out / "pair" / "target", Path(args.data) / "tokenizer.json", int4=True)
    log("exported target")
    dump(out, metrics)
    bake_int4(model, device)
    return model


def dump(out: Path, metrics: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str) + "\n")
