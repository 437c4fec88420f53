"""The DFlash drafter: config parsing (errors name the field, default target layers) and the forward against a
PyTorch rebuild from HF Qwen3 pieces (RMSNorm, rotate-half RoPE) with the context appended in pieces."""
import json

import numpy as np
import pytest

from numbaengine.backends import NUMPY
from numbaengine.config import ConfigError
from numbaengine.drafter import default_layer_ids, load_drafter, parse_draft_config
from numbaengine.weights.dtypes import bf16_to_f32
from numbaengine.weights.shards import Checkpoint
from numbaengine.weights.synth import synth_config, write_draft, write_target

torch = pytest.importorskip("torch", reason="a dev extra: pip install -e '.[dev]'")
qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3", reason="a dev extra: pip install -e '.[dev]'")


@pytest.mark.parametrize("n,d,want", [(36, 5, [1, 9, 17, 25, 33]), (48, 8, [1, 7, 14, 20, 26, 32, 39, 45]),
                                      (32, 5, [1, 8, 15, 22, 29]), (64, 5, [1, 16, 31, 46, 61]),
                                      (28, 5, [1, 7, 13, 19, 25]), (61, 1, [30])])
def test_default_layer_ids(n, d, want):
    assert list(default_layer_ids(n, d)) == want


def raw_config(**over):
    raw = dict(architectures=["DFlashDraftModel"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, rope_theta=1e6,
               block_size=8, num_target_layers=36, dflash_config=dict(mask_token_id=5, target_layer_ids=[1, 9]))
    raw.update(over)
    return raw


def test_config_fields():
    cfg = parse_draft_config(raw_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 5, (1, 9))
    inner = raw_config(dflash_config=dict(mask_token_id=5, block_size=16))
    del inner["block_size"]
    cfg = parse_draft_config(inner)
    assert cfg.block_size == 16 and cfg.target_layer_ids == (1, 33)      # default rule for (36, 2)
    cfg = parse_draft_config(raw_config(rope_theta=None, rope_parameters=dict(rope_theta=5e5)))
    assert cfg.rope_theta == 5e5


@pytest.mark.parametrize("over,field", [
    (dict(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (dict(dflash_config=None), "dflash_config"),
    (dict(dflash_config=dict(target_layer_ids=[1])), "dflash_config.mask_token_id"),
    (dict(dflash_config=dict(mask_token_id=5, target_layer_ids=[1, 99])), "dflash_config.target_layer_ids"),
    (dict(dflash_config=dict(mask_token_id=5, block_size=4)), "block_size"),
    (dict(block_size=None), "block_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_size="64"), "hidden_size"),
    (dict(num_target_layers=0), "num_target_layers"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
])
def test_config_errors(over, field):
    with pytest.raises(ConfigError, match=f"^{field}:") as e:
        parse_draft_config(raw_config(**over))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    write_target(root / "target", synth_config("tiny", layers=3), seed=0)
    write_draft(root / "draft", root / "target", layers=2, block_size=6, seed=1, target_layer_ids=[0, 2])
    from numbaengine.engine import Engine
    target = Engine.load(root / "target", backend="numpy").target
    return root, target


def torch_reference(ckpt, cfg, target, feats, ctx_pos, bonus, start):
    """The DFlash forward as the z-lab code writes it, in float64 from HF Qwen3 pieces (context not cached)."""
    f64 = torch.float64

    def w(name):
        return torch.tensor(bf16_to_f32(ckpt.get(name)), dtype=f64)

    def norm(x, name):
        n = qwen3.Qwen3RMSNorm(x.shape[-1], eps=cfg.rms_norm_eps).to(f64)
        n.weight.data = w(name)
        return n(x)

    qcfg = qwen3.Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                             num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                             rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta))
    rotary = qwen3.Qwen3RotaryEmbedding(qcfg)
    Lb, nh, nkv, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    block = np.full(Lb, cfg.mask_token_id, np.int32)
    block[0] = bonus
    h = torch.tensor(target.embed(block, np.empty((Lb, cfg.hidden_size), np.float32)), dtype=f64)[None]
    ctx = norm(torch.tensor(feats, dtype=f64)[None] @ w("fc.weight").T, "hidden_norm.weight")
    pos = torch.tensor(np.concatenate([ctx_pos, np.arange(start, start + Lb)]))[None]
    cos, sin = rotary(h, pos)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, p + "input_layernorm.weight")
        both = torch.cat([ctx, x], dim=1)
        q = norm((x @ w(p + "self_attn.q_proj.weight").T).view(1, Lb, nh, d), p + "self_attn.q_norm.weight")
        k = norm((both @ w(p + "self_attn.k_proj.weight").T).view(1, -1, nkv, d), p + "self_attn.k_norm.weight")
        v = (both @ w(p + "self_attn.v_proj.weight").T).view(1, -1, nkv, d).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, _ = qwen3.apply_rotary_pos_emb(q, q, cos[:, -Lb:], sin[:, -Lb:])
        _, k = qwen3.apply_rotary_pos_emb(k, k, cos, sin)
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5, dim=-1) @ v           # no mask
        h = h + att.transpose(1, 2).reshape(1, Lb, nh * d) @ w(p + "self_attn.o_proj.weight").T
        x = norm(h, p + "post_attention_layernorm.weight")
        gate, up = x @ w(p + "mlp.gate_proj.weight").T, x @ w(p + "mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(gate) * up) @ w(p + "mlp.down_proj.weight").T
    out = norm(h, "norm.weight")[0, 1:].detach().numpy().astype(np.float32)
    return target.lm_head(out, np.empty((Lb - 1, target.cfg.vocab_size), np.float32))


def test_drafter_matches_torch(pair):
    root, target = pair
    drafter = load_drafter(root / "draft", target, NUMPY)
    cfg = drafter.cfg
    assert json.loads((root / "draft" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    rng = np.random.default_rng(0)
    F, H, n = len(cfg.target_layer_ids), cfg.hidden_size, 11
    hidden = rng.normal(size=(F, n, H)).astype(np.float32)
    ctx = drafter.new_context(32)
    for lo, hi in ((0, 6), (6, 7), (7, 11)):                # incremental appends == one-shot context
        drafter.append(ctx, hidden[:, lo:hi], np.arange(lo, hi, dtype=np.int32))
    assert ctx.length == n
    bonus = 3
    got = drafter.draft(ctx, bonus, n)
    assert got.shape == (cfg.block_size - 1, target.cfg.vocab_size)
    feats = hidden.transpose(1, 0, 2).reshape(n, F * H)
    want = torch_reference(Checkpoint(root / "draft"), cfg, target, feats, np.arange(n), bonus, n)
    err = np.abs(got - want).max()
    assert err < 2e-3 * np.abs(want).max(), f"worst element {err}"


def test_drafter_mask_id_checked(pair, tmp_path):
    root, target = pair
    raw = json.loads((root / "draft" / "config.json").read_text())
    raw["dflash_config"]["mask_token_id"] = target.cfg.vocab_size
    bad = tmp_path / "draft"
    bad.mkdir()
    for f in (root / "draft").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="^dflash_config.mask_token_id:"):
        load_drafter(bad, target, NUMPY)
