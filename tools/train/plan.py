"""Run plan (model sizes, batch sizes, time budgets) and the small helpers every training phase shares."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from tools.train.model import DraftDims, TargetDims


@dataclass
class Plan:
    target: TargetDims
    draft: DraftDims
    seq: int = 512               # target training window
    batch: int = 64              # target training windows per step
    lr: float = 2e-3
    target_seconds: float = 120
    qat_seconds: float = 15
    gen_seconds: float = 30
    gen_batch: int = 2048
    gen_tokens: int = 160        # greedy tokens per prompt
    prompt_lens: tuple = (8, 16, 24, 32, 48, 64)
    draft_seconds: float = 240   # upper bound; the drafter gets what is left before `deadline`
    deadline: float = 400        # whole run, seconds from start
    draft_rows: int = 128        # sequences per drafter step
    draft_blocks: int = 16       # anchors (blocks) per sequence
    draft_lr: float = 1.5e-3
    gamma: float = 7.0           # position weight exp(-(k-1)/gamma)
    soft: float = 0.5            # weight of the soft-label term (CE to the target's distribution)
    eval_windows: int = 10 ** 9  # held-out windows for bits per byte (all)
    max_epochs: float = 8.0      # cap on target training (the corpus is small: more epochs overfit)


PRESETS = {
    "full": lambda: Plan(TargetDims(), DraftDims()),
    "tiny": lambda: Plan(TargetDims(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32,
                                    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                    intermediate_size=128, moe_intermediate_size=32),
                         DraftDims(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=32, intermediate_size=128, target_layer_ids=[0, 2]),
                         seq=64, batch=4, target_seconds=8, qat_seconds=3, gen_seconds=4, gen_batch=8,
                         gen_tokens=40, prompt_lens=(16, 24), draft_seconds=8, deadline=60, draft_rows=4,
                         draft_blocks=2, eval_windows=8),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lr_at(frac: float, peak: float, warm=0.03, floor=0.1) -> float:
    """Linear warmup over the first `warm` of the run, then cosine down to floor * peak."""
    if frac < warm:
        return peak * max(frac / warm, 0.01)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


class Clock:
    """Progress of a phase as a fraction of its step count (if given) or of its time budget."""

    def __init__(self, seconds: float, steps: int | None, max_steps: float = math.inf):
        self.t0, self.seconds, self.steps, self.step, self.max_steps = time.time(), seconds, steps, 0, max_steps

    def frac(self) -> float:
        if self.steps:
            return self.step / self.steps
        return max((time.time() - self.t0) / self.seconds, self.step / self.max_steps)

    def done(self) -> bool:
        return self.frac() >= 1.0

    def elapsed(self) -> float:
        return time.time() - self.t0
