"""Drafter phase: greedy continuations by the frozen target, then DFlash training on them (spec/DDTREE.md:
blocks of [bonus, MASK x 15] anchored in the generated text, each seeing the target features before its anchor)."""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from tools.train.model import Drafter, Target
from tools.train.plan import Clock, Plan, autocast, log, lr_at
from tools.train.target import windows

# ---------------------------------------------------------------- greedy generations

@torch.no_grad()
def greedy(model: Target, prompts, n_new: int, device) -> torch.Tensor:
    """[B, P] prompts -> [B, P + n_new] with the target's greedy continuation (bf16, KV cache)."""
    b, p = prompts.shape
    cache = model.new_cache(b, p + n_new, torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = [prompts]
    with autocast(device):
        logits = model(prompts, cache=cache)[0][:, -1]
        for i in range(n_new):
            nxt = logits.float().argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < n_new:
                logits = model(nxt, cache=cache)[0][:, -1]
    return torch.cat(out, 1)


def prompt_batch(data: dict, n: int, p: int, gen, ends_keys=("def_ends", "nl_ends"), stream="train"):
    """n windows of p tokens ending just before a newline token: half at a function's first body line."""
    halves = []
    for k, key in enumerate(ends_keys):
        ends = data[key]
        ends = ends[ends >= p]
        m = n // len(ends_keys) + (k < n % len(ends_keys))
        pick = ends[torch.randint(0, len(ends), (m,), device=ends.device, generator=gen)]
        halves.append(windows(data[stream], pick - p, p))
    w = torch.cat(halves)
    return w[(w == 0).sum(1) == 0]                      # drop windows that cross a document boundary


def generate_corpus(model: Target, data: dict, plan: Plan, device, seed=1) -> tuple[dict, dict]:
    """Greedy continuations of corpus prompts until the time budget: {prompt_len: [n, P + gen_tokens]}."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    buckets, clock, i = {}, Clock(plan.gen_seconds, None), 0
    while not clock.done() or i == 0:
        p = plan.prompt_lens[i % len(plan.prompt_lens)]
        rows = greedy(model, prompt_batch(data, plan.gen_batch, p, gen), plan.gen_tokens, device)
        buckets.setdefault(p, []).append(rows)
        i += 1
    buckets = {p: torch.cat(v) for p, v in buckets.items()}
    n = sum(len(v) for v in buckets.values())
    log(f"generated {n} sequences x {plan.gen_tokens} tokens in {clock.elapsed():.0f}s")
    val = greedy(model, prompt_batch(data, 256 if device.type == "cuda" else 8, 32, gen, ("held_nl_ends",),
                                     "heldout"), plan.gen_tokens, device)
    return buckets, dict(sequences=n, tokens=n * plan.gen_tokens, seconds=round(clock.elapsed(), 1),
                         batches=i, val=val)


# ---------------------------------------------------------------- drafter

def block_batch(rows, p: int, plan: Plan, gen, anchors=None):
    """Anchors a in [p, T - Lb] per row (random unless given) -> block ids [B, m, Lb] (bonus + masks),
    labels [B, m, Lb-1], anchors [B, m]."""
    b, t = rows.shape
    lb = plan.draft.block_size
    if anchors is None:
        noise = torch.rand(b, t - lb - p + 1, device=rows.device, generator=gen)
        anchors = noise.topk(plan.draft_blocks, -1).indices + p
    m = anchors.shape[1]
    offs = torch.arange(lb, device=rows.device)
    labels = rows.gather(1, (anchors[:, :, None] + offs[1:]).reshape(b, -1)).view(b, m, lb - 1)
    ids = torch.full((b, m, lb), plan.draft.mask_token_id, device=rows.device, dtype=rows.dtype)
    ids[:, :, 0] = rows.gather(1, anchors)
    return ids, labels, anchors


def block_mask(anchors, t: int, lb: int):
    """bool [B, 1, m*Lb, T + m*Lb]: a block sees context positions < its anchor and its own block."""
    b, m = anchors.shape
    dev = anchors.device
    ctx = (torch.arange(t, device=dev)[None, None, :] < anchors[:, :, None]).repeat_interleave(lb, 1)  # [B, Q, T]
    blk = torch.arange(m, device=dev).repeat_interleave(lb)
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)                                              # [B, Q, Q]
    return torch.cat((ctx, own), -1)[:, None]


def draft_loss(drafter: Drafter, target: Target, rows, p: int, plan: Plan, gen, anchors=None):
    """Position-weighted CE (hard greedy labels mixed with the target's soft distribution) of the drafter on
    blocks anchored in the generated part; also the accepted greedy chain length per block [B, m]."""
    d, (b, t) = plan.draft, rows.shape
    with torch.no_grad():
        t_logits, hidden = target(rows, hidden_ids=tuple(d.target_layer_ids), logits=plan.soft > 0)
        feats = torch.cat(hidden, -1)
    ids, labels, anchors = block_batch(rows, p, plan, gen, anchors)
    m = anchors.shape[1]
    q_pos = (anchors[:, :, None] + torch.arange(d.block_size, device=rows.device)).reshape(b, -1)
    with torch.no_grad():
        emb = target.embed_tokens(ids.reshape(b, -1))
    ctx_pos = torch.arange(t, device=rows.device).expand(b, t)
    hid = drafter(emb, q_pos, feats, ctx_pos, block_mask(anchors, t, d.block_size))
    hid = hid.view(b, m, d.block_size, -1)[:, :, 1:]
    logits = target.lm_head(hid).float()                                         # [B, m, Lb-1, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(b, m, -1)
    if plan.soft > 0:
        src = (anchors[:, :, None] + torch.arange(d.block_size - 1, device=rows.device)).reshape(b, -1)
        soft = torch.softmax(t_logits.gather(1, src[:, :, None].expand(-1, -1, t_logits.shape[-1])).float(), -1)
        soft_ce = -(soft.view(b, m, d.block_size - 1, -1) * torch.log_softmax(logits, -1)).sum(-1)
        ce = (1 - plan.soft) * ce + plan.soft * soft_ce
    wpos = torch.exp(-torch.arange(d.block_size - 1, device=rows.device) / plan.gamma)
    loss = (ce * wpos).sum(-1).mean() / wpos.sum()
    accepted = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1)          # [B, m]
    return loss, 1 + accepted.float().mean(), accepted


def train_drafter(drafter: Drafter, target: Target, buckets: dict, val, plan: Plan, device, seed=2) -> dict:
    target.eval()
    for p_ in target.parameters():
        p_.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=plan.draft_lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = list(buckets)
    sizes = torch.tensor([len(buckets[k]) for k in keys], dtype=torch.float)
    rng = torch.Generator().manual_seed(seed)
    clock, last, seen = Clock(plan.draft_seconds, None), time.time(), 0
    drafter.train()
    while not clock.done():
        for g in opt.param_groups:
            g["lr"] = lr_at(clock.frac(), plan.draft_lr)
        p = keys[torch.multinomial(sizes, 1, generator=rng).item()]
        rows = buckets[p][torch.randint(0, len(buckets[p]), (plan.draft_rows,), device=device, generator=gen)]
        with autocast(device):
            loss, tau, _ = draft_loss(drafter, target, rows, p, plan, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        clock.step += 1
        seen += plan.draft_rows * plan.draft_blocks
        if time.time() - last > 10 or clock.done():
            last = time.time()
            log(f"draft step {clock.step} loss {loss.item():.4f} train-tau(top1 chain) {tau.item():.2f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {clock.elapsed():.0f}s")
    return dict(steps=clock.step, blocks=seen, seconds=round(clock.elapsed(), 1), final_loss=loss.item(),
                val_tau_chain=val_tau(drafter, target, val, plan, device))


@torch.no_grad()
def val_tau(drafter, target, val, plan: Plan, device, p=32) -> float:
    """DFlash greedy tau per round on held-out-prompt generations: accepted lengths at every anchor, then the
    rounds a decoder would take (start at p, jump by tau) -- the per-round mean, not the per-anchor mean."""
    drafter.eval()
    lb, (b, t) = plan.draft.block_size, val.shape
    all_anchors = torch.arange(p, t - lb + 1, device=val.device)
    acc = []
    with autocast(device):
        for chunk in all_anchors.split(16):
            acc.append(draft_loss(drafter, target, val, p, plan, None, chunk.expand(b, -1))[2])
    acc = torch.cat(acc, 1).cpu().numpy()                                      # [B, n_anchors]
    taus = []
    for row in acc:
        j = 0
        while j < len(row):
            taus.append(int(row[j]) + 1)
            j += taus[-1]
    drafter.train()
    return float(np.mean(taus))
