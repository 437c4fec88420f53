"""Text <-> token ids for a checkpoint folder: HF tokenizer.json (`tokenizers`), Kimi's tiktoken.model (`tiktoken`,
imported only when needed), or plain token ids ("1 2 3") when the folder has no tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

KIMI_PATTERN = "|".join([        # Kimi K2's pre-tokenizer split (tokenization_kimi.py)
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_RESERVED = 256              # special-token slots after the BPE ranks


class IdTokenizer:
    """No vocabulary: a prompt is token ids written as text ("1 2 3" or "1,2,3"); decode writes them back."""
    name = "token ids"

    def encode(self, text):
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"prompt: {text[:40]!r} is not a list of token ids (this model has no tokenizer)") \
                from None

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)

    def token_str(self, i):
        return str(int(i))

    def token_text(self, i):
        return str(int(i))


class HFTokenizer:
    """A HF `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path):
        from tokenizers import Tokenizer
        self.tok, self.name = Tokenizer.from_file(str(path)), str(path)

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_str(self, i):
        """The vocabulary entry (byte-level BPE spells a newline and 7 spaces 'ĊĠĠĠĠĠĠĠ')."""
        s = self.tok.id_to_token(int(i))
        return s if s is not None else f"<|{int(i)}|>"

    def token_text(self, i):
        """The text the token stands for, decoded on its own ('\\n       ')."""
        return self.decode([i])


class TiktokenTokenizer:
    """Kimi's `tiktoken.model` (base64 BPE ranks) plus special tokens from tokenizer_config.json."""

    def __init__(self, path):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ImportError(f"{path}: reading tiktoken.model needs the `tiktoken` package "
                              "(pip install tiktoken)") from None
        ranks = load_tiktoken_bpe(str(path))
        names = _added_tokens(Path(path).parent / "tokenizer_config.json")
        n = len(ranks)
        special = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
        self.enc = tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special)
        self.name = str(path)

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        """Known ids decode as one byte string (multi-byte characters survive); unknown ones as <|id|>."""
        parts, run = [], []
        for i in (int(x) for x in ids):
            if 0 <= i < self.enc.n_vocab:
                run.append(i)
                continue
            parts.append(self.enc.decode(run, errors="replace"))
            parts.append(f"<|{i}|>")
            run = []
        parts.append(self.enc.decode(run, errors="replace"))
        return "".join(parts)

    def token_str(self, i):
        return self.decode([i])

    def token_text(self, i):
        return self.decode([i])


def _added_tokens(config_path):
    """id -> content of the special tokens named in tokenizer_config.json (empty when the file is absent)."""
    if not config_path.exists():
        return {}
    added = json.loads(config_path.read_text()).get("added_tokens_decoder") or {}
    return {int(k): v["content"] if isinstance(v, dict) else str(v) for k, v in added.items()}


def load_tokenizer(model_dir):
    """The tokenizer of a checkpoint folder: tokenizer.json, else tiktoken.model, else token ids."""
    d = Path(model_dir)
    if (d / "tokenizer.json").exists():
        return HFTokenizer(d / "tokenizer.json")
    if (d / "tiktoken.model").exists():
        return TiktokenTokenizer(d / "tiktoken.model")
    return IdTokenizer()


class TextStream:
    """tokenizer.decode(tokens) of a token list that only grows, decoding a window of recent tokens per update
    rather than the whole list (a long output costs the same per round as a short one).

    text = stable + pending. stable is the decode of tokens[:read] and ends with a whole character, so what
    follows decodes on its own (byte-level BPE: the bytes end at a character boundary); pending, the text of the
    tokens past read, still ends in U+FFFD (a character split between tokens) and may change. An update decodes
    tokens[prefix:], prefix being the boundary before read: starting a few tokens back keeps the tokenizer's
    joining rules between tokens (the id tokenizer's spaces, a leading-space marker) as in the full decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stable, self.pending = "", ""
        self.prefix = self.read = 0          # tokens[prefix:read] decode to base, the end of stable
        self.base = ""

    @property
    def text(self) -> str:
        return self.stable + self.pending

    def peek(self, tokens, end) -> str:
        """decode(tokens[:end])[len(stable):] for end >= read, without changing the stream."""
        return self.tokenizer.decode(tokens[self.prefix:end])[len(self.base):]

    def update(self, tokens, new=None):
        """Take the tokens added since the last update (new: their peek(tokens, len(tokens)) when known)."""
        new = self.peek(tokens, len(tokens)) if new is None else new
        if not new or new.endswith("\ufffd"):
            self.pending = new
            return
        self.stable += new
        self.pending = ""
        self.prefix, self.read = self.read, len(tokens)
        self.base = self.tokenizer.decode(tokens[self.prefix:self.read])
