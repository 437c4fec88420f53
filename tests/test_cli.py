"""The command line (python -m numbaengine.run) on a tiny synthetic pair and the shipped pair, and the tokenizer
loaders."""
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from numbaengine import run
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
    assert out["interrupted"] is False and "model:" in p.stderr


def test_show_tree_text_and_json(pair):
    p = cli("--prompt", "5 6 7", *model_args(pair), "--show-tree", "--max-new-tokens", "6", "--budget", "5",
            "--stop", "")
    assert p.returncode == 0, p.stderr
    assert "round " not in p.stdout and len(p.stdout.split()) == 6           # stdout: the 6 token ids alone
    lines = [ln for ln in p.stderr.splitlines() if not ln.startswith("model:")]
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert rounds and all("tau" in ln for ln in rounds)
    assert sum("root" in ln for ln in lines) == len(rounds)
    assert sum("-> bonus" in ln for ln in lines) == len(rounds)
    assert all(ln.endswith("*") for ln in lines if "root" in ln)              # the root is always accepted
    assert any("q=" in ln for ln in lines) and "tokens/s" in lines[-2]
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
    assert p.returncode == 2 and p.stderr == f"error: model directory not found: {tmp_path / 'nowhere'}\n"
    p = cli("--prompt", "1", "--draft", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and p.stderr == f"error: draft directory not found: {tmp_path / 'nowhere'}\n"
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
    for line in p.stderr:                                           # --show-tree writes the trees to stderr
        if line.startswith("round 2"):                              # generation is under way
            break
    else:
        pytest.fail(p.stdout.read())
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted after" in err and "Traceback" not in err
    n = int(err.split("interrupted after")[1].split()[0])
    words = out.split()                                             # stdout: the tokens so far, decoded, alone
    assert n >= 3 and len(words) == n and all(w.isdigit() for w in words)


def interrupt_after_two_rounds(monkeypatch):
    """Engine.generate raises KeyboardInterrupt after its second round, as Ctrl-C would."""
    real = Engine.generate

    def generate_then_interrupt(self, *args, on_round, **kw):
        def hook(index, out, tokens):
            on_round(index, out, tokens)
            if out is not None and len(on_round.taus) == 2:
                raise KeyboardInterrupt
        return real(self, *args, on_round=hook, **kw)

    monkeypatch.setattr(Engine, "generate", generate_then_interrupt)


def test_ctrl_c_with_json_prints_one_json_object(pair, monkeypatch, capsys):
    interrupt_after_two_rounds(monkeypatch)
    assert run.main(["--prompt", "5 6 7", *model_args(pair), "--json", "--max-new-tokens", "50", "--stop", ""]) == 130
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["interrupted"] is True and got["stats"]["rounds"] == 2
    assert got["stats"]["new_tokens"] == len(got["tokens"]) >= 3 and got["text"] == IdTokenizer().decode(got["tokens"])
    assert f"interrupted after {len(got['tokens'])} tokens" in err


def test_ctrl_c_without_json_prints_the_text_so_far(pair, monkeypatch, capsys):
    interrupt_after_two_rounds(monkeypatch)
    assert run.main(["--prompt", "5 6 7", *model_args(pair), "--max-new-tokens", "50", "--stop", ""]) == 130
    out, err = capsys.readouterr()
    n = int(err.split("interrupted after")[1].split()[0])
    assert n >= 3 and len(out.split()) == n and out.endswith("\n") and "tokens/s" not in out


# --- stdout, streaming ----------------------------------------------------------------------------------------------

def test_stdout_is_only_the_text():
    p = cli("--prompt", "def add(a, b):", "--max-new-tokens", "6", "--backend", "numpy")
    assert p.returncode == 0, p.stderr
    want = Engine.load(backend="numpy").generate("def add(a, b):", 6)
    assert p.stdout == want.text + "\n"
    assert p.stderr.startswith("model:") and "tokens/s" in p.stderr.splitlines()[-2]


class FakeTerminal(io.StringIO):
    """A stdout that says it is a terminal and keeps every write."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def isatty(self):
        return True

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_text_streams_on_a_terminal(monkeypatch, capsys):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", term)
    assert run.main(["--prompt", "def add(a, b):", "--max-new-tokens", "12", "--backend", "numpy"]) == 0
    want = Engine.load(backend="numpy").generate("def add(a, b):", 12)
    assert term.getvalue() == want.text + "\n"
    assert len([w for w in term.writes if w != "\n"]) > want.stats["rounds"] // 2     # piece by piece, not at once
    assert "tokens/s" in capsys.readouterr().err


class ByteTokenizer:
    """Token ids are UTF-8 bytes, so a character can be cut between tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_waits_for_the_rest_of_a_cut_character():
    text = "hé €!"
    ids, out = list(text.encode()), FakeTerminal()
    stream = run.Stream(ByteTokenizer(), out, live=True)
    for n in range(1, len(ids) + 1):
        stream.update(ids[:n])
    stream.finish(text)
    assert out.getvalue() == text + "\n" and not any("\ufffd" in w for w in out.writes)
    assert len(out.writes) > 3


def test_stream_when_the_decoder_rewrites_its_prefix():
    out = FakeTerminal()
    stream = run.Stream(None, out, live=True)
    stream.write("a b")
    stream.finish("a. b")                                   # e.g. a decoder's cleanup step joined differently
    assert out.getvalue() == "a b\na. b\n"


def test_not_a_terminal_prints_once():
    out = io.StringIO()
    stream = run.Stream(IdTokenizer(), out, live=False)
    stream.update([1, 2])
    assert out.getvalue() == ""
    stream.finish("1 2 3")
    assert out.getvalue() == "1 2 3\n"


# --- help, errors ---------------------------------------------------------------------------------------------------

def test_help_shows_every_default_and_says_the_pair_is_a_toy(capsys):
    with pytest.raises(SystemExit):
        run.main(["--help"])
    text = capsys.readouterr().out
    top = " ".join(text.split("options:")[0].split())
    assert "toy model" in top and "plausible-looking Python, not a useful model" in top
    flat = " ".join(text.split())
    for action in run.parser()._actions:
        if action.required or action.nargs == 0:                                 # --prompt; flags, --help
            continue
        default = "default: " + (str(action.default) if action.default is not None else "")
        assert default in flat, action.option_strings


def test_devices_on_numpy_is_refused(pair, monkeypatch, capsys):
    for backend, extra in [("numpy", []), ("auto", []), ("numpy", ["--show-tree"])]:
        monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")     # auto: no GPU is ready
        argv = ["--prompt", "5", *model_args(pair)[:4], "--backend", backend, "--devices", "0,1", *extra]
        assert run.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("error: --devices needs the cuda backend") and len(err) == 2, err


def test_memory_error_is_one_line(monkeypatch, capsys):
    def no_memory(*args, **kw):
        raise MemoryError("memory: the weights need at least 600.0 GiB per GPU but 139.0 GiB are free")

    monkeypatch.setattr(Engine, "load", no_memory)
    assert run.main(["--prompt", "x", "--max-context", "100000000"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "error: memory: the weights need at least 600.0 GiB per GPU but 139.0 GiB are free"


@pytest.mark.parametrize("mode,head", [("ddtree", "ddtree (budget 8): "), ("dflash", "dflash (block 4): "),
                                       ("ar", "ar: ")])
def test_stats_line_names_the_knob_of_its_mode(pair, capsys, mode, head):
    argv = ["--prompt", "5 6 7", *model_args(pair), "--mode", mode, "--budget", "8", "--max-new-tokens", "5"]
    assert run.main(argv) == 0
    line, times = capsys.readouterr().err.splitlines()[-2:]
    assert line.startswith(head) and "tokens/s" in line
    assert ("budget" in line) == (mode == "ddtree") and ("tau" in line) == (mode != "ar")
    assert times.startswith("time: load ") and " decode " in times and " wall " in times


def test_stats_split_load_compile_capture_prefill_decode(pair, capsys):
    """The --json stats say where the command's time went; the phases cover the wall time they are part of."""
    assert run.main(["--prompt", "5 6 7", *model_args(pair), "--json", "--max-new-tokens", "6"]) == 0
    t = json.loads(capsys.readouterr().out)["stats"]["time_s"]
    assert list(t) == ["load", "compile", "capture", "warmup", "prefill", "decode", "wall"], t
    assert t["load"] > 0 and t["prefill"] > 0 and t["decode"] > 0
    assert sum(v for k, v in t.items() if k != "wall") <= t["wall"] + 1e-3, t


@pytest.mark.parametrize("flags,want_dir,want_on", [([], None, True), (["--no-kernel-cache"], None, False),
                                                    (["--kernel-cache", "KC"], "KC", True)])
def test_kernel_cache_flags(pair, tmp_path, monkeypatch, capsys, flags, want_dir, want_on):
    """--kernel-cache DIR and --no-kernel-cache set where compiled kernels are kept and whether they are used."""
    from numbaengine.kernels import cache
    monkeypatch.setenv("NUMBAENGINE_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.delenv("NUMBAENGINE_KERNEL_CACHE", raising=False)
    flags = [str(tmp_path / f) if f == "KC" else f for f in flags]
    try:
        assert run.main(["--prompt", "5 6 7", *model_args(pair), "--max-new-tokens", "2", *flags]) == 0
        assert cache.cache_dir() == (tmp_path / want_dir if want_dir else tmp_path / "env")
        assert cache.enabled() is want_on
    finally:
        cache.configure()


# --- trees ----------------------------------------------------------------------------------------------------------

def test_show_tree_prints_readable_token_text():
    p = cli("--prompt", "def add(a, b):", "--max-new-tokens", "8", "--backend", "numpy", "--show-tree")
    assert p.returncode == 0, p.stderr
    tree = [ln for ln in p.stderr.splitlines() if "q=" in ln or "root" in ln]
    assert tree and not any(c in ln for ln in tree for c in "\u010a\u0120")    # no byte-level BPE 'Ċ', 'Ġ'
    assert any("'\\n" in ln for ln in tree)                                    # a newline shows as \n


def test_tree_svg_one_picture_per_round(tmp_path, capsys):
    argv = ["--prompt", "def add(a, b):", "--max-new-tokens", "8", "--backend", "numpy", "--show-tree", "--json",
            "--tree-svg", str(tmp_path / "trees")]
    assert run.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(SHIPPED_PAIR / "target")
    files = sorted((tmp_path / "trees").iterdir())
    assert [f.name for f in files] == [f"round_{r:04d}.svg" for r in range(1, out["stats"]["rounds"] + 1)]
    for f, r in zip(files, out["rounds"]):
        svg = ET.parse(f).getroot()
        texts = {e.text for e in svg.iter() if e.tag.endswith("text")}
        ids = {e.get("id") for e in svg.iter()}
        for node in r["accepted"]:
            assert repr(tok.token_text(r["tokens"][node])) in texts and f"node{node}-accepted" in ids
        assert repr(tok.token_text(r["new_tokens"][-1])) in texts and "bonus" in ids


def test_tree_svg_without_matplotlib(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)               # import fails
    argv = ["--prompt", "5", *model_args(pair), "--tree-svg", str(tmp_path)]
    assert run.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("pip install matplotlib")


# --- tokenizers -----------------------------------------------------------------------------------------------------

def test_id_tokenizer():
    tok = IdTokenizer()
    assert tok.encode("1, 2 3") == [1, 2, 3] and tok.decode([4, 5]) == "4 5" and tok.token_text(7) == "7"
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
    assert loaded.encode("the cat sat") == [0, 1, 2] and loaded.token_str(4) == "mat" and loaded.token_text(4) == "mat"
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
    assert tok.token_text(104) == "h"
    assert tok.decode([104, 256 + 300]) == "h<|556|>"                     # unknown ids stay visible


def test_token_text_is_the_decoded_token():
    tok = load_tokenizer(SHIPPED_PAIR / "target")
    ids = tok.encode("):\n        return")
    symbols = [tok.token_str(i) for i in ids]
    assert any("\u010a" in s for s in symbols)                               # byte-level BPE spells \n as 'Ċ'
    assert [tok.token_text(i) for i in ids] == [s.replace("\u010a", "\n").replace("\u0120", " ") for s in symbols]


def test_json_budget_only_for_ddtree(capsys):
    """--json stats carry the budget only where it shapes the round (ddtree); ar and dflash say null, not 16."""
    import json

    from numbaengine import run
    for mode, want in (("ddtree", 4), ("dflash", None), ("ar", None)):
        assert run.main(["--prompt", "x", "--mode", mode, "--budget", "4", "--max-new-tokens", "3", "--json"]) in (0, None)
        assert json.loads(capsys.readouterr().out)["stats"]["budget"] == want, mode
