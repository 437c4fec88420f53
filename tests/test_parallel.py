"""The multi-device layout on CPU: a simulated n-device target equals the unsharded one; the plan covers every tensor."""
import numpy as np
import pytest

from numbaengine import Engine
from numbaengine.config import load_config
from numbaengine.parallel import local_slice, split_rule
from weights.layout import target_tensors
from weights.synth import synth_config, write_target

WIDE = dict(num_attention_heads=8, n_routed_experts=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    write_target(d, synth_config("tiny", layers=3, quant="int4", **WIDE), seed=int(np.random.SeedSequence().entropy % 2**31))
    return d


def greedy(target, prompt, steps):
    """Plain autoregressive greedy decoding on the target (absorbed MLA after a naive prefill)."""
    cache = target.new_cache(len(prompt) + steps)
    logits, _ = target.forward(prompt, np.arange(len(prompt), dtype=np.int32), cache, form="naive")
    cache.length = len(prompt)
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits, _ = target.forward(np.array(out[-1:], np.int32), np.array([cache.length], np.int32), cache)
        cache.length += 1
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_equals_unsharded(model_dir, n):
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, size=11).astype(np.int32)
    # float32 latent cache for the logits: with a bf16 cache, float32 reordering in the all-reduce can flip a
    # latent's bf16 rounding and amplify 1e-6 differences to ~1e-4
    one = Engine.load(model_dir, backend="numpy", cache_dtype="float32")
    many = Engine.load(model_dir, backend="numpy", devices=list(range(n)), cache_dtype="float32")
    assert len(many.target.shards) == n
    ref, got = one.forward_logits(prompt), many.forward_logits(prompt)
    assert np.abs(ref - got).max() / np.abs(ref).max() < 1e-4      # float32 sums in another order
    one, many = Engine.load(model_dir, backend="numpy"), Engine.load(model_dir, backend="numpy", devices=list(range(n)))
    assert greedy(one.target, prompt, 6) == greedy(many.target, prompt, 6)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_plan_covers_every_tensor_exactly_once(model_dir, n):
    cfg = load_config(model_dir)
    for name, (shape, _) in target_tensors(cfg).items():
        count = np.zeros(shape, np.int32)
        for rank in range(n):
            index = local_slice(name, shape, cfg, rank, n)
            if index is not None:
                count[index] += 1
        want = n if split_rule(name) is None else 1      # replicated tensors live on every device
        assert (count == want).all(), name


@pytest.mark.parametrize("n,field", [(3, "num_attention_heads"), (32, "num_attention_heads")])
def test_indivisible_layout_is_a_clear_error(model_dir, n, field):
    with pytest.raises(ValueError, match=field):
        Engine.load(model_dir, backend="numpy", devices=list(range(n)))
