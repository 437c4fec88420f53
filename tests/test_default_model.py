"""The shipped default pair (weights/default): files load, match the layout tables, fit the size budget, and greedy
DFlash / DDTree reproduce greedy autoregressive decoding on held-out prompts (numpy backend, CPU)."""
import json
from pathlib import Path

import pytest

from numbaengine.weights import SHIPPED_PAIR

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft"
PROMPTS = ROOT / "tools" / "train" / "heldout.json"
MAX_BYTES = 40_000_000

@pytest.fixture(scope="module")
def engine():
    from numbaengine import Engine
    return Engine.load(TARGET, DRAFT, backend="numpy")


def test_size_budget():
    total = sum(p.stat().st_size for d in (TARGET, DRAFT) for p in d.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"default pair is {total} bytes (budget {MAX_BYTES})"


def test_target_layout():
    from numbaengine.config import load_config
    from numbaengine.weights.layout import target_tensors
    from numbaengine.weights.shards import Checkpoint
    cfg = load_config(TARGET)
    assert cfg.quant.method == "int4" and cfg.quant.group_size == 32 and cfg.yarn is not None
    assert cfg.n_routed_experts >= 16 and cfg.num_experts_per_tok >= 2 and cfg.first_k_dense_replace == 1
    ck = Checkpoint(TARGET)
    expected = target_tensors(cfg)
    ck.check_all(expected)
    assert set(ck.names()) == set(expected)


def test_draft_config(engine):
    raw = json.loads((DRAFT / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["mask_token_id"] == engine.tokenizer.encode("<|mask|>")[0]
    assert raw["block_size"] in (8, 16)


def test_tokenizer_round_trip(engine):
    text = "def f(x):\n    return x + 1"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


@pytest.mark.parametrize("mode,budget", [("dflash", 0), ("ddtree", 8), ("ddtree", 32)])
def test_greedy_speculation_reproduces_ar(engine, mode, budget):
    prompts = [p["text"] for p in json.loads(PROMPTS.read_text())["prompts"][:2]]
    for prompt in prompts:
        ar = engine.generate(prompt, 24, mode="ar", temperature=0.0, stop=[])
        spec = engine.generate(prompt, 24, mode=mode, budget=budget, temperature=0.0, stop=[])
        assert spec.tokens == ar.tokens, f"{mode} budget {budget} diverged from ar on {prompt[:40]!r}"
        assert spec.stats["tau_mean"] >= 1.0
