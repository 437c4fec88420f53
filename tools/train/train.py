"""Train the default pair end to end: target (+ INT4 QAT), greedy generations, DFlash drafter, export.

Phases run against wall-clock budgets (or fixed step counts), so one GPU call does it all:
  python -m tools.train.train --data runs/data --out OUT            (GPU; presets in PRESETS)
  python -m tools.train.train --data runs/data --out /tmp/t --preset tiny   (CPU smoke test, ~1 min)
Writes OUT/pair/target, OUT/pair/draft, OUT/metrics.json and logs to stdout.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tools.train.draft import generate_corpus, train_drafter
from tools.train.export import export_drafter, load_drafter, load_target
from tools.train.model import Drafter, init_drafter
from tools.train.plan import PRESETS, log
from tools.train.target import dump, freeze, load_data, train_and_export_target


def run(args) -> dict:
    t_start = time.time()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    plan = PRESETS[args.preset]()
    for k in ("target_seconds", "qat_seconds", "gen_seconds", "draft_seconds", "deadline", "gen_batch", "draft_lr",
              "soft", "prompt_lens"):
        if getattr(args, k) is not None:
            setattr(plan, k, tuple(getattr(args, k)) if k == "prompt_lens" else getattr(args, k))
    data = load_data(Path(args.data), device)
    out, metrics = Path(args.out), dict(plan=asdict(plan), device=str(device), torch=torch.__version__,
                                        gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
    log(f"device {device} gpu {metrics['gpu']} train tokens {len(data['train'])} heldout {len(data['heldout'])}")
    if args.target_dir:
        model = load_target(args.target_dir).to(device)
        freeze(model, device)
        metrics["target_from"] = args.target_dir
    else:
        model = train_and_export_target(plan, data, device, out, metrics, args)

    buckets, gstats = generate_corpus(model, data, plan, device, seed=args.seed + 1)
    val = gstats.pop("val")
    metrics["generation"] = gstats
    if args.draft_init:
        drafter = load_drafter(args.draft_init)
        plan.draft = drafter.d
        metrics["draft_init"] = args.draft_init
    else:
        drafter = Drafter(plan.draft)
        init_drafter(drafter, args.seed + 2)
    drafter.to(device)
    metrics["draft_params"] = sum(p.numel() for p in drafter.parameters())
    plan.draft_seconds = max(10.0, min(plan.draft_seconds, plan.deadline - (time.time() - t_start) - 20))
    log(f"drafter budget {plan.draft_seconds:.0f}s")
    metrics["draft_train"] = train_drafter(drafter, model, buckets, val, plan, device, seed=args.seed + 2)
    log(f"drafter val tau (greedy chain, block {plan.draft.block_size}): {metrics['draft_train']['val_tau_chain']:.2f}")
    export_drafter(drafter.float(), model.d, out / "pair" / "draft")
    metrics["total_seconds"] = round(time.time() - t_start, 1)
    dump(out, metrics)
    log(f"done in {metrics['total_seconds']}s")
    return metrics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/data")
    ap.add_argument("--out", default="runs/train")
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    for k in ("target_seconds", "qat_seconds", "gen_seconds", "draft_seconds", "deadline"):
        ap.add_argument("--" + k.replace("_", "-"), type=float)
    ap.add_argument("--gen-batch", type=int)
    ap.add_argument("--draft-lr", type=float)
    ap.add_argument("--soft", type=float, help="weight of the soft-label term in the drafter loss")
    ap.add_argument("--prompt-lens", type=int, nargs="+", help="generation prompt lengths, one per batch in turn")
    ap.add_argument("--target-dir", help="skip target training: use this exported target (drafter-only run)")
    ap.add_argument("--draft-init", help="start the drafter from this exported drafter")
    ap.add_argument("--target-steps", type=int, help="fixed step count instead of the time budget")
    ap.add_argument("--qat-steps", type=int)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
