"""The package squats no generic top-level import name: from the repo root, Hugging Face's own `kernels` package
(which transformers imports) is the one found, and importing numbaengine loads no top-level kernels/weights/tools."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_in_repo_root(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_import_numbaengine_loads_no_generic_top_level_module():
    out = run_in_repo_root(
        "import sys, numbaengine, numbaengine.weights, numbaengine.run\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'weights', 'tools')))")
    assert out.strip() == "[]", out


def test_transformers_builds_deepseek_v3_from_the_repo_root():
    out = run_in_repo_root(
        "import kernels, transformers\n"
        "from transformers import DeepseekV3Config, DeepseekV3ForCausalLM\n"
        "cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,\n"
        "    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,\n"
        "    num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,\n"
        "    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)\n"
        "m = DeepseekV3ForCausalLM(cfg)\n"
        "print(type(m).__name__, kernels.__file__)")
    name, where = out.split()
    assert name == "DeepseekV3ForCausalLM"
    assert not Path(where).resolve().is_relative_to(REPO), f"`kernels` resolved inside the repo: {where}"
