"""Config parsing: every supported spelling, and a one-line error naming the field for every bad one."""
import copy
import json

import pytest

from numbaengine.config import ConfigError, load_config

BASE = dict(model_type="kimi_k2", vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=64, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-6, rope_theta=50000.0,
            rope_scaling=dict(type="yarn", factor=32, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1,
                              mscale=1.0, mscale_all_dim=1.0),
            quantization_config=dict(quant_method="compressed-tensors", format="pack-quantized",
                                     config_groups=dict(group_0=dict(weights=dict(num_bits=4, type="int",
                                                                                  symmetric=True, strategy="group",
                                                                                  group_size=32)))))


def test_kimi_k2_with_rope_scaling():
    cfg = load_config(BASE)
    assert cfg.yarn.factor == 32 and cfg.yarn.beta_fast == 1 and cfg.quant.method == "int4"
    assert cfg.latent_dim == 80 and cfg.prefix == ""
    assert cfg.softmax_scale == pytest.approx(48 ** -0.5 * (0.1 * __import__("math").log(32) + 1) ** 2)


def test_rope_parameters_spelling_carries_theta():
    raw = copy.deepcopy(BASE)
    rope = raw.pop("rope_scaling")
    raw["rope_parameters"] = dict(rope, rope_type="yarn", rope_theta=1234.0)
    del raw["rope_parameters"]["type"]
    cfg = load_config(raw)
    assert cfg.rope_theta == 1234.0 and cfg.yarn.factor == 32


def test_kimi_k25_wrapper(tmp_path):
    text = {k: v for k, v in BASE.items() if k not in ("model_type", "quantization_config")}
    raw = dict(model_type="kimi_k25", text_config=dict(text, model_type="kimi_k2"),
               quantization_config=BASE["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path)
    assert cfg.prefix == "language_model." and cfg.quant.method == "int4" and cfg.hidden_size == 256


def test_defaults_and_fp8_and_grouped():
    raw = {k: BASE[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                "num_attention_heads")}
    raw.update(model_type="deepseek_v3", quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128]))
    cfg = load_config(raw)
    assert (cfg.n_group, cfg.topk_group, cfg.n_routed_experts, cfg.kv_lora_rank) == (8, 4, 256, 512)
    assert cfg.quant.method == "fp8" and cfg.yarn is None


BAD = [
    (dict(model_type="llama"), "model_type"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(vocab_size=-3), "vocab_size"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=2), "topk_group"),
    (dict(rope_scaling=dict(type="longrope", factor=2)), "rope_scaling.type"),
    (dict(rope_scaling=dict(type="yarn")), "rope_scaling.factor"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(quantization_config=dict(quant_method="gptq")), "quantization_config.quant_method"),
    (dict(quantization_config=dict(BASE["quantization_config"], format="int-quantized")), "quantization_config.format"),
    (dict(moe_intermediate_size=48), "moe_intermediate_size"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_the_field(change, field):
    raw = copy.deepcopy(BASE)
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    msg = str(err.value)
    assert msg.startswith(field) or f"{field}:" in msg, msg
    assert "\n" not in msg


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
