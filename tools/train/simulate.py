"""Greedy (T = 0) acceptance of an exported pair, simulated exactly with the fp32 torch twins.

At T = 0 the committed text is the target's greedy continuation whatever the drafts are, so each round can be
scored against it: DFlash tau = 1 + leading drafts equal to it; DDTree tau = 1 + depth of the deepest tree path
(best-first tree of `budget` nodes, DDTREE.md section 3) that follows it. A training-side check that needs no
engine; tools/acceptance.py measures the same through the engine.
Run: python -m tools.train.simulate numbaengine/weights/default/target numbaengine/weights/default/draft --budgets 1 8 32 128
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from tokenizers import Tokenizer

from numbaengine import ddtree
from tools.train.corpus import PROMPTS_FILE
from tools.train.export import load_drafter, load_target


def accepted(mode, bonus, logp, future) -> int:
    """Drafted tokens accepted by a greedy target whose next tokens are `future`: the engine's tree for the
    round (numbaengine/ddtree.py draft_tree; DFlash = the argmax chain) walked with each node's target token
    (a node at depth d would be followed by future[d] if its path matches)."""
    budget = len(logp) if mode == "dflash" else int(mode[6:])
    tree = ddtree.draft_tree("dflash" if mode == "dflash" else "ddtree", bonus, logp, budget)
    post = np.array([future[d] if d < len(future) else -1 for d in tree.depths], np.int32)
    path, _ = ddtree.walk(tree, post)
    return len(path) - 1


@torch.no_grad()
def greedy_ids(target, prompt: list, n: int) -> list:
    ids = torch.tensor([prompt])
    cache = target.new_cache(1, len(prompt) + n, torch.float32)
    logits, out = target(ids, cache=cache)[0][:, -1], []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = target(torch.tensor([[out[-1]]]), cache=cache)[0][:, -1]
    return out


@torch.no_grad()
def draft_logp(drafter, target, feats, start: int, bonus: int) -> np.ndarray:
    """Drafter log-probs f32[Lb-1, V] for positions start+1.. given features of positions < start."""
    d = drafter.d
    ids = torch.tensor([[bonus] + [d.mask_token_id] * (d.block_size - 1)])
    pos = torch.arange(start, start + d.block_size)[None]
    hid = drafter(target.embed_tokens(ids), pos, feats[:, :start], torch.arange(start)[None])
    return torch.log_softmax(target.lm_head(hid[0, 1:]), -1).numpy()


def simulate(target, drafter, prompt: list, n_new: int, budgets) -> dict:
    """tau per round for 'dflash' and each DDTree budget over one prompt's greedy continuation."""
    lb = drafter.d.block_size
    g = greedy_ids(target, prompt, n_new + lb)
    seq = torch.tensor([prompt + g])
    feats = torch.cat(target(seq, hidden_ids=tuple(drafter.d.target_layer_ids), logits=False)[1], -1)
    taus = {m: [] for m in ["dflash"] + [f"ddtree{b}" for b in budgets]}
    for mode, out in taus.items():
        j = 0
        while j < n_new:
            logp = draft_logp(drafter, target, feats, len(prompt) + j, g[j])
            future = g[j + 1:j + lb]
            a = accepted(mode, g[j], logp, future)
            out.append(a + 1)
            j += a + 1
    return taus


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    target, drafter = load_target(args.target).eval(), load_drafter(args.draft).eval()
    tok = Tokenizer.from_file(f"{args.target}/tokenizer.json")
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"][:args.prompts]
    t0, all_taus = time.time(), {}
    for p in prompts:
        for mode, t in simulate(target, drafter, tok.encode(p["text"]).ids, args.max_new_tokens, args.budgets).items():
            all_taus.setdefault(mode, []).extend(t)
    res = {m: dict(tau=round(float(np.mean(t)), 3), rounds=len(t), hist=np.bincount(t).tolist())
           for m, t in all_taus.items()}
    for m, r in res.items():
        print(f"{m:10s} tau {r['tau']:.2f}  rounds {r['rounds']}")
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens in {time.time() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=res), f, indent=1)


if __name__ == "__main__":
    main()
