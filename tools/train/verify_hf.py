"""Check the torch twin and an exported target against HF transformers' DeepseekV3ForCausalLM in fp32.

Two checks: (1) HF from_pretrained on a bf16 export of the model (names, config, rope/yarn/mscale, router) gives
the same logits as the twin with bf16-rounded weights; (2) for an INT4 export, the twin (experts dequantized
exactly) against HF holding the same fp32 weights. Run: python -m tools.train.verify_hf [TARGET_DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from tools.train.export import export_target, load_target
from tools.train.model import Target, TargetDims, init_target


def hf_from_twin(model: Target):
    """HF DeepseekV3ForCausalLM (fp32) holding the twin's exact weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tools.train.export import target_config
    cfg = DeepseekV3Config(**{k: v for k, v in target_config(model.d, False).items()
                              if k not in ("architectures", "model_type", "torch_dtype")})
    hf = DeepseekV3ForCausalLM(cfg).float().eval()
    hf.load_state_dict(hf_state(model), strict=True)
    return hf


def hf_state(model: Target) -> dict:
    out = {}
    for name, p in model.state_dict().items():
        key = name if name == "lm_head.weight" else "model." + name
        if name.endswith("experts_gate"):
            up = model.state_dict()[name.replace("experts_gate", "experts_up")]
            out[key.replace("experts_gate", "experts.gate_up_proj")] = torch.cat((p, up), 1)
        elif name.endswith("experts_down"):
            out[key.replace("experts_down", "experts.down_proj")] = p
        elif not name.endswith("experts_up"):
            out[key] = p
    return out


def logits_diff(model: Target, hf, n_tokens: int, seed=0) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.d.vocab_size, (1, n_tokens), generator=g)
    with torch.no_grad():
        ours = model(ids)[0]
        theirs = hf(ids).logits
    return float((ours - theirs).abs().max() / theirs.abs().max())


def round_bf16(model: Target) -> Target:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.bfloat16().float())
    return model


def check_export(model: Target, n_tokens: int) -> float:
    """bf16 export -> HF from_pretrained vs the twin with bf16-rounded weights."""
    from transformers import DeepseekV3ForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        export_target(model, tmp, int4=False)
        hf = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        return logits_diff(round_bf16(model), hf, n_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", nargs="?", help="exported target dir (default: a random small model)")
    ap.add_argument("--tokens", type=int, default=700, help="sequence length (past original_max 512: yarn)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.target:
        model = load_target(args.target).eval()
    else:
        model = Target(TargetDims(num_hidden_layers=3, hidden_size=128, intermediate_size=256)).eval()
        init_target(model, seed=0, std=0.05)
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.normal_(0, 0.05)
    twin = logits_diff(model, hf_from_twin(model), args.tokens)
    exp = check_export(model, args.tokens)
    print(f"max |twin - HF| / max|HF| logits: same fp32 weights {twin:.2e}; bf16 export via from_pretrained {exp:.2e}")
    return 0 if twin < 1e-4 and exp < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
