"""Corpus, tokenizer and held-out split for the default model pair, from the running interpreter's standard library.

File rule: every `*.py` under sysconfig's stdlib folder, sorted by relative path, minus the folders in SKIP_DIRS,
`_sysconfigdata*` files and files that are not strict UTF-8. Held out (never trained on, not seen by the
tokenizer trainer): files whose sha256(relative path) is 0 mod HELDOUT_MOD. The list actually used is written to
tools/train/heldout.json, so a different interpreter version can be checked against it.
Run: python -m tools.train.corpus --out runs/data
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import numpy as np

SKIP_DIRS = ("site-packages", "dist-packages", "lib-dynload", "pydoc_data", "encodings", "__pycache__")
HELDOUT_MOD = 40
VOCAB = 4096
EOS, MASK = "<|endoftext|>", "<|mask|>"       # ids 0 and 1
PROMPTS_FILE = Path(__file__).with_name("heldout.json")


def stdlib_files(root=None) -> list[tuple[str, str]]:
    """(relative path, text) of every corpus file, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        if rel.split("/")[0] in SKIP_DIRS or rel.split("/")[0].startswith("config-") or "/__pycache__/" in rel:
            continue
        if p.name.startswith("_sysconfigdata"):
            continue
        try:
            out.append((rel, p.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MOD == 0


def train_tokenizer(texts):
    """Byte-level BPE with VOCAB ids; ids 0/1 are the eos and the drafter's mask token."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1 and tok.get_vocab_size() == VOCAB
    return tok


def byte_table(tok) -> tuple[np.ndarray, np.ndarray]:
    """Per vocab id: number of UTF-8 bytes it stands for (0 for specials) and whether it starts with a newline."""
    from tokenizers import pre_tokenizers  # noqa: F401  (same mapping as GPT-2's bytes_to_unicode)
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: b for b in chars}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    char_to_byte = {chr(c): b for b, c in table.items()}
    nbytes, starts_nl = np.zeros(VOCAB, np.int32), np.zeros(VOCAB, bool)
    for s, i in tok.get_vocab().items():
        if s in (EOS, MASK):
            continue
        nbytes[i] = len(s)
        starts_nl[i] = char_to_byte[s[0]] == 10
    return nbytes, starts_nl


def def_spans(text: str) -> list[tuple[int, int, int]]:
    """(def line, first body line, char offset of the newline that ends the first body line) per function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    starts = np.cumsum([0] + [len(s) for s in text.splitlines(keepends=True)])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            body = node.body[0].lineno
            if body > node.lineno and body < len(starts) - 1:
                end = int(starts[body]) - 1            # the '\n' closing line `body` (1-based)
                if text[end] == "\n":
                    out.append((node.lineno, body, end))
    return sorted(out)


def prompt_text(text: str, def_line: int, body_line: int) -> str:
    """Signature lines plus the first body line of a function, dedented, no trailing newline."""
    lines = text.splitlines()[def_line - 1: body_line]
    return textwrap.dedent("\n".join(lines)).rstrip()


def encode_docs(tok, docs):
    """Token stream of docs joined by eos, plus per doc (start offset in the stream, encoding)."""
    encs = tok.encode_batch([t for _, t in docs])
    stream, starts, pos = [], [], 0
    for e in encs:
        starts.append(pos)
        stream.extend(e.ids + [0])
        pos += len(e.ids) + 1
    return np.asarray(stream, np.uint16), starts, encs


def def_ends(docs, starts, encs) -> np.ndarray:
    """Stream positions of the newline token that ends a function's first body line (generation prompt ends)."""
    out = []
    for (_, text), s0, enc in zip(docs, starts, encs):
        first = {o[0]: i for i, o in enumerate(enc.offsets)}
        for _, _, end in def_spans(text):
            if end in first:
                out.append(s0 + first[end])
    return np.asarray(out, np.int64)


def heldout_prompts(tok, docs, n=64, max_tokens=96) -> list[dict]:
    """n function-signature prompts spread evenly over the held-out files' functions."""
    cands = []
    for rel, text in docs:
        for d, b, _ in def_spans(text):
            p = prompt_text(text, d, b)
            if p and len(tok.encode(p).ids) <= max_tokens and p.splitlines()[-1].strip():
                cands.append(dict(file=rel, line=d, text=p))
    idx = np.linspace(0, len(cands) - 1, min(n, len(cands))).round().astype(int)
    return [cands[i] for i in sorted(set(idx.tolist()))]


def build(out: Path) -> dict:
    t0 = time.time()
    files = stdlib_files()
    train = [(r, t) for r, t in files if not is_heldout(r)]
    held = [(r, t) for r, t in files if is_heldout(r)]
    tok = train_tokenizer([t for _, t in train])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    train_ids, starts, encs = encode_docs(tok, train)
    held_ids, _, _ = encode_docs(tok, held)
    nbytes, starts_nl = byte_table(tok)
    ends = def_ends(train, starts, encs)
    np.save(out / "train.npy", train_ids)
    np.save(out / "heldout.npy", held_ids)
    np.save(out / "def_ends.npy", ends)
    np.save(out / "token_bytes.npy", nbytes)
    np.save(out / "starts_nl.npy", starts_nl)
    prompts = heldout_prompts(tok, held)
    meta = dict(python=sys.version.split()[0], stdlib=sysconfig.get_paths()["stdlib"], n_files=len(files),
                n_train_files=len(train), n_heldout_files=len(held),
                train_bytes=sum(len(t.encode()) for _, t in train), heldout_bytes=sum(len(t.encode()) for _, t in held),
                train_tokens=len(train_ids), heldout_tokens=len(held_ids), def_ends=len(ends),
                skip_dirs=list(SKIP_DIRS), heldout_mod=HELDOUT_MOD, seconds=round(time.time() - t0, 1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    PROMPTS_FILE.write_text(json.dumps(dict(meta=meta, heldout_files=[r for r, _ in held], prompts=prompts),
                                       indent=1) + "\n")
    return meta


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/data")
    print(json.dumps(build(Path(ap.parse_args().out)), indent=1))
