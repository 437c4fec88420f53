"""tools/bench.py's byte floors on the shipped pair (NumPy backend): every weight counts once however many views
name it (a drafter layer's `kv` rows sit inside its `qkv`), and each phase's floor names what that phase reads;
--refill's continuous batching decodes every request."""
import dataclasses
from types import SimpleNamespace

import numpy as np

from numbaengine.engine import Engine
from numbaengine.weights import SHIPPED_PAIR
from tools.bench import nbytes, phase_floors, round_floor


def test_nbytes_counts_overlapping_views_once():
    rng = np.random.default_rng()
    a = rng.integers(0, 2 ** 16, (int(rng.integers(8, 40)), 24), dtype=np.uint16)
    i, j = sorted(rng.choice(len(a), 2, replace=False))
    row = a.strides[0]
    assert nbytes(a, a[i:], [a[:j]]) == a.nbytes
    assert nbytes(a[:j], a[i:]) == a.nbytes                          # overlapping rows i..j-1
    assert nbytes(a[:i], a[i:j]) == j * row                        # adjacent spans: both whole
    assert nbytes(a, np.zeros(5, np.float32)) == a.nbytes + 20


def test_floors_of_the_shipped_pair():
    eng = Engine.load(SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft", backend="numpy")
    d, w = eng.drafter, eng.target.w
    V, Lb = eng.cfg.vocab_size, d.block_size
    dev = SimpleNamespace(shape=SimpleNamespace(batch=1), drafter=d, target=eng.target,
                          logits=np.zeros((17, V), np.float32), draft_logits=np.zeros((1, Lb - 1, V), np.float32))
    parts = round_floor(eng, dev, 17, 100)
    layer_fields = [f.name for f in dataclasses.fields(d.layers[0]) if f.name != "kv"]    # kv: a view of qkv
    distinct = sum(getattr(layer, f).nbytes for layer in d.layers for f in layer_fields)
    assert all(np.shares_memory(layer.kv, layer.qkv) for layer in d.layers)
    assert parts["drafter"] == distinct + d.fc.nbytes + w.lm_head.nbytes
    phases = phase_floors(parts, dev)
    assert phases["commit"] == d.fc.nbytes + sum(layer.kv.nbytes for layer in d.layers)
    assert phases["draft"] == distinct + w.lm_head.nbytes + parts["drafter context"]
    assert phases["build"] == (Lb - 1) * V * 4 and phases["walk"] == 17 * V * 4
    assert phases["verify"] == sum(v for k, v in parts.items() if not k.startswith("drafter"))
    assert phases["verify"] > w.lm_head.nbytes > 0


def test_refill_case_decodes_every_request():
    """tools.bench --refill: waves x batch requests through the scheduler's slots, each to its max tokens (no stop
    ids), timed from the first submit to the last finish."""
    from tools.bench import refill_case
    eng = Engine.load(SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft", backend="numpy")
    row = refill_case(eng, "ddtree", 4, 2, 5, 2)
    assert row["refill_requests"] == 4 and row["refill_tokens"] == 4 * 5, row
    assert 0 < row["refill_wall_s"] and row["refill_tokens_per_s"] == row["refill_tokens"] / row["refill_wall_s"]
