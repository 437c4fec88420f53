"""Write and read the engine's checkpoint formats for the torch twins in tools/train/model.py.

Target: config.json (model_type deepseek_v3, YaRN rope_scaling, compressed-tensors quantization_config when int4),
model.safetensors, tokenizer.json. Drafter: config.json (DFlashDraftModel + dflash_config), model.safetensors.
Names and shapes are checked against weights.layout (the one source of truth); INT4 packing is weights.int4.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from numbaengine.config import parse_config
from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16
from numbaengine.weights.int4 import dequant_int4, quantize_int4
from numbaengine.weights.layout import draft_tensors, target_tensors
from numbaengine.weights.shards import Checkpoint, write_checkpoint
from tools.train.model import DraftDims, Drafter, Target, TargetDims

GROUP = 32
QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
EXPERT_PARAMS = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}


def target_config(d: TargetDims, int4: bool) -> dict:
    """config.json of the target, readable by numbaengine.config and HF DeepseekV3Config."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": d.vocab_size, "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "moe_intermediate_size": d.moe_intermediate_size, "num_hidden_layers": d.num_hidden_layers,
        "num_attention_heads": d.num_attention_heads, "num_key_value_heads": d.num_attention_heads,
        "n_shared_experts": d.n_shared_experts, "n_routed_experts": d.n_routed_experts,
        "num_experts_per_tok": d.num_experts_per_tok, "routed_scaling_factor": d.routed_scaling_factor,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "first_k_dense_replace": d.first_k_dense_replace, "q_lora_rank": d.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank, "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim, "v_head_dim": d.v_head_dim, "hidden_act": "silu",
        "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta, "rope_interleave": True,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": d.yarn_factor,
                         "original_max_position_embeddings": d.original_max_position_embeddings,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": d.max_position_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
    }
    if int4:
        cfg["quantization_config"] = QUANT_CONFIG
    return cfg


def draft_config(d: DraftDims, t: TargetDims) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d.hidden_size,
        "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
        "intermediate_size": d.intermediate_size, "rms_norm_eps": d.rms_norm_eps, "rope_theta": d.rope_theta,
        "hidden_act": "silu", "vocab_size": t.vocab_size, "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
        "block_size": d.block_size, "num_target_layers": t.num_hidden_layers,
        "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": list(d.target_layer_ids),
                          "block_size": d.block_size},
    }


def _bf16(t: torch.Tensor):
    return f32_to_bf16(t.detach().float().cpu().numpy()), "BF16"


def target_arrays(model: Target, int4: bool) -> dict:
    """{checkpoint name: (array, dtype)} for the target; routed experts INT4 (quantize_int4) or bf16."""
    out = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "inv_freq":
            continue
        key = name if name == "lm_head.weight" else "model." + name
        param = name.rsplit(".", 1)[-1]
        if param in EXPERT_PARAMS:
            out.update(_expert_arrays(key.rsplit(".", 1)[0], EXPERT_PARAMS[param], p, int4))
        elif param == "e_score_correction_bias":
            out[key] = (p.detach().float().cpu().numpy().astype(np.float32), "F32")
        else:
            out[key] = _bf16(p)
    return out


def _expert_arrays(prefix: str, proj: str, w: torch.Tensor, int4: bool) -> dict:
    out, w = {}, w.detach().float().cpu().numpy()              # [E, out, in]
    for e in range(w.shape[0]):
        name = f"{prefix}.experts.{e}.{proj}"
        if int4:
            packed, scale = quantize_int4(w[e], GROUP)
            out[name + ".weight_packed"] = (packed, "I32")
            out[name + ".weight_scale"] = (scale, "BF16")
            out[name + ".weight_shape"] = (np.asarray(w[e].shape, np.int32), "I32")
        else:
            out[name + ".weight"] = (f32_to_bf16(w[e]), "BF16")
    return out


def check_layout(arrays: dict, expected: dict, what: str) -> None:
    """Names, shapes and dtypes must equal weights.layout's table exactly."""
    got = {n: (tuple(a.shape), dt) for n, (a, dt) in arrays.items()}
    exp = {n: (tuple(s), dt) for n, (s, dt) in expected.items()}
    if got != exp:
        diff = sorted(set(got.items()) ^ set(exp.items()))[:6]
        raise ValueError(f"{what}: tensors differ from weights.layout: {diff}")


def export_target(model: Target, out_dir, tokenizer=None, int4=True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target_config(model.d, int4)
    arrays = target_arrays(model, int4)
    check_layout(arrays, target_tensors(parse_config(cfg)), "target")
    write_checkpoint(out, arrays)
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    if tokenizer:
        shutil.copy(tokenizer, out / "tokenizer.json")
    return out


def export_drafter(model: Drafter, t: TargetDims, out_dir) -> Path:
    d, out = model.d, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {n: _bf16(p) for n, p in model.named_parameters()}
    check_layout(arrays, draft_tensors(d.hidden_size, d.num_hidden_layers, d.num_attention_heads,
                                       d.num_key_value_heads, d.head_dim, d.intermediate_size,
                                       len(d.target_layer_ids)), "drafter")
    write_checkpoint(out, arrays)
    (out / "config.json").write_text(json.dumps(draft_config(d, t), indent=1) + "\n")
    return out


# ---------------------------------------------------------------- reading back (fp32 torch twins)

def target_dims(cfg: dict) -> TargetDims:
    r = cfg["rope_scaling"]
    keys = set(TargetDims.__dataclass_fields__) - {"yarn_factor", "original_max_position_embeddings"}
    return TargetDims(yarn_factor=r["factor"], original_max_position_embeddings=r["original_max_position_embeddings"],
                      **{k: cfg[k] for k in keys})


def _f32(ck: Checkpoint, name: str) -> torch.Tensor:
    a = ck.get(name)
    return torch.from_numpy(bf16_to_f32(a) if ck.dtype(name) == "BF16" else np.asarray(a, np.float32).copy())


def load_target(path) -> Target:
    """Exported target -> fp32 Target with INT4 experts dequantized exactly."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    d, ck = target_dims(cfg), Checkpoint(path)
    model = Target(d)
    state = {}
    for name in model.state_dict():
        key = name if name == "lm_head.weight" else "model." + name
        param = name.rsplit(".", 1)[-1]
        if param in EXPERT_PARAMS:
            state[name] = torch.stack([_expert_f32(ck, f"{key.rsplit('.', 1)[0]}.experts.{e}.{EXPERT_PARAMS[param]}")
                                       for e in range(d.n_routed_experts)])
        else:
            state[name] = _f32(ck, key)
    model.load_state_dict(state)
    return model


def _expert_f32(ck: Checkpoint, name: str) -> torch.Tensor:
    if name + ".weight" in ck:
        return _f32(ck, name + ".weight")
    return torch.from_numpy(dequant_int4(ck.get(name + ".weight_packed"), ck.get(name + ".weight_scale"), GROUP))


def load_drafter(path) -> Drafter:
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = set(DraftDims.__dataclass_fields__) - {"block_size", "mask_token_id", "target_layer_ids"}
    dc = cfg["dflash_config"]
    d = DraftDims(block_size=cfg["block_size"], mask_token_id=dc["mask_token_id"],
                  target_layer_ids=list(dc["target_layer_ids"]), **{k: cfg[k] for k in keys})
    model, ck = Drafter(d), Checkpoint(path)
    model.load_state_dict({n: _f32(ck, n) for n in model.state_dict()})
    return model
