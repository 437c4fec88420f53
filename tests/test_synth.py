"""weights.synth: format-exact random checkpoints (tensors exactly as weights.layout says, configs the engine and
HF transformers both read), the DFlash drafter writer and the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numbaengine.config import load_config
from numbaengine.weights.dtypes import bf16_to_f32, e4m3_to_f32, f32_to_bf16
from numbaengine.weights.int4 import dequant_int4
from numbaengine.weights.layout import draft_tensors, target_tensors
from numbaengine.weights.shards import INDEX, Checkpoint
from numbaengine.weights.synth import (
    default_target_layer_ids,
    synth_config,
    write_draft,
    write_target,
)

REPO = Path(__file__).resolve().parents[1]


def assert_matches_layout(d: Path):
    cfg = load_config(d)
    ck = Checkpoint(d)
    want = {cfg.prefix + n: s for n, s in target_tensors(cfg).items()}
    assert set(ck.names()) == set(want)
    ck.check_all(want)
    return cfg, ck


@pytest.mark.parametrize("quant", ["int4", "none", "fp8"])
def test_tiny_matches_layout(tmp_path, quant):
    cfg, ck = assert_matches_layout(write_target(tmp_path, synth_config("tiny", quant=quant), seed=3))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts) == (512, 256, 3, 8)
    assert cfg.quant.method == quant and cfg.yarn.factor == 32 and cfg.yarn.original_max_position_embeddings == 256
    for name in ck.names():
        a = ck.get(name)
        if ck.dtype(name) == "BF16":
            assert np.isfinite(bf16_to_f32(a)).all(), name
        elif ck.dtype(name) == "F8_E4M3":
            assert np.isfinite(e4m3_to_f32(a)).all(), name
    norm = bf16_to_f32(ck.get("model.layers.1.input_layernorm.weight"))
    assert 0.85 < norm.min() and norm.max() < 1.15
    bias = ck.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert (bias < 0).any() and (bias > 0).any() and np.abs(bias).max() < 0.1


def test_int4_config_and_values(tmp_path):
    raw = synth_config("tiny")
    q = raw["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
    w = q["config_groups"]["group_0"]["weights"]
    assert {k: w[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")} == \
        dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    assert "lm_head" in q["ignore"] and "re:.*self_attn.*" in q["ignore"]
    _, ck = assert_matches_layout(write_target(tmp_path, raw, seed=0))
    p = "model.layers.2.mlp.experts.5.down_proj."
    assert list(ck.get(p + "weight_shape")) == [256, 64]
    w = dequant_int4(ck.get(p + "weight_packed"), ck.get(p + "weight_scale"), 32)
    assert 0.7 < w.std() * np.sqrt(64) < 1.3                      # std ~ 1/sqrt(fan_in)
    assert set(np.unique((ck.get(p + "weight_packed")[:, :, None] >> np.arange(0, 32, 4)) & 0xF)) == set(range(16))


def test_fp8_config(tmp_path):
    raw = synth_config("tiny", quant="fp8", layers=2)
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    _, ck = assert_matches_layout(write_target(tmp_path, raw))
    assert ck.shape("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv") == (2, 1)


@pytest.mark.parametrize("scheme", ["stream", "counter"])
def test_values_independent_of_sharding_and_deterministic(tmp_path, scheme):
    raw = synth_config("tiny", layers=2)
    a = Checkpoint(write_target(tmp_path / "a", raw, seed=7, scheme=scheme))
    b = Checkpoint(write_target(tmp_path / "b", raw, seed=7, shard_mb=0.25, scheme=scheme))
    c = Checkpoint(write_target(tmp_path / "c", raw, seed=8, scheme=scheme))
    assert (tmp_path / "b" / INDEX).exists() and len(list((tmp_path / "b").glob("*.safetensors"))) > 2
    assert all(np.array_equal(a.get(n), b.get(n)) for n in a.names())
    assert not np.array_equal(a.get("lm_head.weight"), c.get("lm_head.weight"))


@pytest.mark.parametrize("scheme", ["stream", "counter"])
def test_k25_wrapper(tmp_path, scheme):
    raw = synth_config("tiny", layers=2, wrapper="k25")
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["num_hidden_layers"] == 2
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    cfg, ck = assert_matches_layout(write_target(tmp_path / "k25", raw, seed=1, scheme=scheme))
    assert cfg.prefix == "language_model." and cfg.quant.method == "int4"
    assert all(n.startswith("language_model.") for n in ck.names())
    plain = Checkpoint(write_target(tmp_path / "plain", synth_config("tiny", layers=2), seed=1, scheme=scheme))
    for n in ("lm_head.weight", "model.layers.1.mlp.experts.3.up_proj.weight_packed"):
        assert np.array_equal(ck.get("language_model." + n), plain.get(n))


def test_overrides_reach_the_config(tmp_path):
    raw = synth_config("tiny", layers=2, quant="none", n_group=4, topk_group=2, tie_word_embeddings=True,
                       rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128,
                                         mscale=1.0, mscale_all_dim=1.0))
    cfg, ck = assert_matches_layout(write_target(tmp_path, raw))
    assert (cfg.n_group, cfg.topk_group, cfg.yarn.factor, cfg.tie_word_embeddings) == (4, 2, 4.0, True)
    assert "lm_head.weight" not in ck


def test_k2_preset_dims():
    cfg = load_config(synth_config("k2"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts) == (163840, 7168, 64, 384)
    dims = (cfg.num_experts_per_tok, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.moe_intermediate_size)
    assert dims == (8, 1536, 512, 2048)
    assert cfg.num_hidden_layers == 2 and cfg.yarn.factor == 64 and cfg.rms_norm_eps == 1e-5
    t = target_tensors(cfg)
    assert t["model.layers.1.mlp.experts.383.gate_proj.weight_packed"] == ((2048, 896), "I32")
    assert t["model.layers.1.mlp.experts.383.down_proj.weight_scale"] == ((7168, 64), "BF16")


def test_draft_writer(tmp_path):
    write_target(tmp_path / "t", synth_config("tiny", layers=3), seed=0)
    d = write_draft(tmp_path / "d", tmp_path / "t", layers=2, block_size=6, seed=1, target_layer_ids=[0, 2])
    c = json.loads((d / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["hidden_size"] == 256 and c["vocab_size"] == 512
    assert (c["block_size"], c["num_target_layers"], c["num_hidden_layers"]) == (6, 3, 2)
    assert c["dflash_config"] == dict(mask_token_id=511, target_layer_ids=[0, 2], block_size=6)
    want = draft_tensors(256, 2, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                         c["intermediate_size"], 2)
    ck = Checkpoint(d)
    assert set(ck.names()) == set(want)
    ck.check_all(want)
    assert c["num_attention_heads"] * c["head_dim"] == ck.shape("layers.0.self_attn.q_proj.weight")[0]
    with pytest.raises(ValueError, match="target_layer_ids"):
        write_draft(tmp_path / "bad", tmp_path / "t", target_layer_ids=[3])


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]       # released Qwen3-8B drafter
    assert default_target_layer_ids(61, 1) == [30]


def test_cli(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "numbaengine.weights.synth", *a], cwd=REPO, capture_output=True,
                                    text=True, check=True)
    assert "wrote" in run("--preset", "tiny", "--layers", "2", "--out", str(tmp_path / "t"), "--quant", "int4",
                          "--wrapper", "k25", "--seed", "5", "--shard-mb", "0.5").stdout
    assert_matches_layout(tmp_path / "t")
    run("--draft", "--target", str(tmp_path / "t"), "--out", str(tmp_path / "d"), "--block-size", "4")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["block_size"] == 4
    run("--preset", "tiny", "--layers", "2", "--out", str(tmp_path / "c"), "--scheme", "counter")
    assert_matches_layout(tmp_path / "c")
    assert "--scheme" in subprocess.run([sys.executable, "-m", "numbaengine.weights.synth", "--scheme", "hash",
                                         "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True).stderr


def test_transformers_reads_tiny_int4(tmp_path):
    """HF transformers + compressed-tensors load the synthetic INT4 checkpoint with no missing or unexpected keys,
    dequantize the experts to bf16(our dequant), and activations stay O(1) through the layers."""
    torch = pytest.importorskip("torch", reason="a dev extra: pip install -e '.[dev]'")
    transformers = pytest.importorskip("transformers", reason="a dev extra: pip install -e '.[dev]'")
    d = write_target(tmp_path, synth_config("tiny"), seed=2)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ck = Checkpoint(d)
    p = "model.layers.2.mlp.experts.3.down_proj."
    ours = dequant_int4(ck.get(p + "weight_packed"), ck.get(p + "weight_scale"), 32)
    theirs = model.model.layers[2].mlp.experts.down_proj[3].detach().float().numpy()
    assert np.array_equal(theirs, bf16_to_f32(f32_to_bf16(ours)))
    with torch.no_grad():
        out = model(torch.tensor([[1, 50, 300, 7, 9]]), output_hidden_states=True)
    stds = [h.float().std().item() for h in out.hidden_states]
    assert all(0.3 < s < 5 for s in stds), stds
