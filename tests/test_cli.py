"""The command line (python -m numbaengine.run) on a tiny synthetic pair, and the tokenizer loaders."""
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from numbaengine.backends import NUMPY
from numbaengine.drafter import load_drafter
from numbaengine.engine import Engine
from numbaengine.generate import generate
from numbaengine.tokenizer import IdTokenizer, load_tokenizer
from numbaengine.weights import SHIPPED_PAIR
from numbaengine.weights.synth import synth_config, write_draft, write_target

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, vocab_size=256)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_target(root / "target", synth_config("tiny", layers=2, **SMALL), seed=0)
    write_draft(root / "draft", root / "target", layers=1, block_size=4, seed=1, target_layer_ids=[1])
    return root


def cli(*args, env=None):
    cmd = [sys.executable, "-m", "numbaengine.run", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def model_args(pair):
    return ["--model", str(pair / "target"), "--draft", str(pair / "draft"), "--backend", "numpy"]


def test_json_output_matches_the_library(pair):
    p = cli("--prompt", "5 6 7", *model_args(pair), "--json", "--max-new-tokens", "9", "--budget", "8", "--stop", "")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    engine = Engine.load(pair / "target", backend="numpy")
    want = generate(engine.target, load_drafter(pair / "draft", engine.target, NUMPY), None, [5, 6, 7], 9, budget=8,
                    stop=[])
    assert out["tokens"] == want.tokens and len(out["tokens"]) == 9
    assert out["text"] == want.text
    assert out["stats"]["rounds"] == want.stats["rounds"] and out["stats"]["mode"] == "ddtree"
    assert "model:" in p.stderr


def test_show_tree_text_and_json(pair):
    p = cli("--prompt", "5 6 7", *model_args(pair), "--show-tree", "--max-new-tokens", "6", "--budget", "5",
            "--stop", "")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert rounds and all("tau" in ln for ln in rounds)
    assert sum("root" in ln for ln in lines) == len(rounds)
    assert sum("-> bonus" in ln for ln in lines) == len(rounds)
    assert all(ln.endswith("*") for ln in lines if "root" in ln)              # the root is always accepted
    assert any("q=" in ln for ln in lines) and "tokens/s" in lines[-1]
    p = cli("--prompt", "5 6 7", *model_args(pair), "--show-tree", "--json", "--max-new-tokens", "6", "--budget", "5",
            "--stop", "")
    out = json.loads(p.stdout)
    assert len(out["rounds"]) == out["stats"]["rounds"]
    r = out["rounds"][0]
    assert len(r["tokens"]) == len(r["parents"]) == len(r["depths"]) == 6 and r["accepted"][0] == 0


def test_show_tree_needs_the_host_trees(pair):
    p = cli("--prompt", "5 6 7", *model_args(pair), "--show-tree", "--backend", "cuda", "--max-new-tokens", "2")
    assert p.returncode == 2 and "--backend numpy" in p.stderr and p.stderr.count("\n") <= 2, p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--budget", "-1"], "--budget"),
    (["--budget", "5000"], "--budget"),
    (["--mode", "beam"], "--mode"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--stop", "a,b"], "--stop"),
])
def test_bad_input_one_line_exit_2(pair, args, needle):
    p = cli("--prompt", "5 6 7", *model_args(pair), *args)
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("model:")]
    assert len(errors) == 1 and errors[0].startswith("error:") and needle in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_missing_model_and_missing_draft(pair, tmp_path):
    p = cli("--prompt", "1", "--model", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and p.stderr.splitlines()[-1].startswith("error:") and "Traceback" not in p.stderr
    p = cli("--prompt", "1", "--model", str(pair / "target"), "--backend", "numpy")       # ddtree without --draft
    assert p.returncode == 2 and "--draft" in p.stderr.splitlines()[-1]
    p = cli("--prompt", "1", "--model", str(pair / "target"), "--backend", "numpy", "--mode", "ar", "--json",
            "--max-new-tokens", "3")
    assert p.returncode == 0 and len(json.loads(p.stdout)["tokens"]) <= 3


def test_default_is_the_shipped_pair():
    p = cli("--prompt", "def add(a, b):", "--max-new-tokens", "4", "--backend", "numpy", "--json")
    assert p.returncode == 0, p.stderr
    assert "shipped default" in p.stderr and str(SHIPPED_PAIR / "target") in p.stderr
    out = json.loads(p.stdout)
    assert out["draft"].endswith("draft") and 1 <= len(out["tokens"]) <= 4


def test_ctrl_c_prints_what_was_generated(pair):
    cmd = [sys.executable, "-m", "numbaengine.run", "--prompt", "5 6 7", *model_args(pair), "--show-tree",
           "--max-new-tokens", "100000", "--max-context", "100010", "--stop", ""]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in p.stdout:
        if line.startswith("round 2"):                              # generation is under way
            break
    else:
        pytest.fail(p.stderr.read())
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted after" in err and "Traceback" not in err
    n = int(err.split("interrupted after")[1].split()[0])
    words = out.splitlines()[-1].split()[-n:]                       # the tokens so far, decoded
    assert n >= 3 and len(words) == n and all(w.isdigit() for w in words)


# --- tokenizers -----------------------------------------------------------------------------------------------------

def test_id_tokenizer():
    tok = IdTokenizer()
    assert tok.encode("1, 2 3") == [1, 2, 3] and tok.decode([4, 5]) == "4 5"
    with pytest.raises(ValueError, match="^prompt:"):
        tok.encode("hello")


def test_hf_tokenizer_json(pair, tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="a dev extra: pip install -e '.[dev]'")
    words = ["the", "cat", "sat", "on", "mat", "[UNK]"] + [f"w{i}" for i in range(250)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model = tmp_path / "target"
    shutil.copytree(pair / "target", model)
    tok.save(str(model / "tokenizer.json"))
    loaded = load_tokenizer(model)
    assert loaded.encode("the cat sat") == [0, 1, 2] and loaded.token_str(4) == "mat"
    engine = Engine.load(model, backend="numpy")
    r = generate(engine.target, None, loaded, "the cat sat", 5, mode="ar", stop=[])
    assert r.text == loaded.decode(r.tokens) and len(r.tokens) == 5


def test_tiktoken_model(tmp_path):
    ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (tmp_path / "tiktoken.model").write_text(ranks)
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="tiktoken"):
            load_tokenizer(tmp_path)
        return
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("hi 你")
    assert ids == list("hi 你".encode()) and tok.decode(ids) == "hi 你"
    assert tok.decode([104, 256 + 300]) == "h<|556|>"                     # unknown ids stay visible
