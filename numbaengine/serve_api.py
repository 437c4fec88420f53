"""The OpenAI request bodies the server accepts, their checks (a 400 naming the field), its error type, and the
checkpoint's chat template (tokenizer_config.json `chat_template`, rendered with jinja2 as HF does)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from numbaengine.budget import AUTO
from numbaengine.ddtree import MAX_BUDGET


class APIError(Exception):
    """An HTTP error with the OpenAI body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status, message, param=None, code=None, type="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": dict(message=self.message, type=self.type, param=self.param, code=self.code)}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


class Strict(BaseModel):
    """No type coercion ("16" is not an integer); an explicit null means the default."""
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class Speculative(Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    mode: Literal["ddtree", "dflash", "ar"] | None = None
    budget: int | Literal["auto"] | None = None

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v):
        if v == AUTO or (type(v) is int and 0 <= v <= MAX_BUDGET):
            return v
        raise PydanticCustomError("budget", "an integer in 0..{max} (drafted tree nodes per round) or 'auto', "
                                  "got {got}", dict(max=MAX_BUDGET, got=json.dumps(v)))


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields of both endpoints. Unknown OpenAI fields (user, metadata, ...) are accepted and ignored."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None          # extension: replaces the checkpoint's eos ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | None = None           # extension: mode and budget for this request


class CompletionBody(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_value(self):
        """The one prompt, text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"prompt: {len(p)} prompts given; one prompt per request is supported", "prompt")
            return p[0]
        return p


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = ""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# the only value each of these OpenAI fields may take here (a null is always fine)
SUPPORTED_ONLY = {"n": 1, "best_of": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False,
                  "logprobs": False, "top_logprobs": 0, "logit_bias": {}, "tools": [], "suffix": ""}


def parse_body(cls, raw: bytes):
    """A checked request body, or a 400 that names the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = field_path(err["loc"])
        raise APIError(400, f"{param}: {err['msg']}", param) from None
    for name, only in SUPPORTED_ONLY.items():
        if data.get(name) is not None and data[name] != only:
            raise APIError(400, f"{name}: only {json.dumps(only)} is supported, got {json.dumps(data[name])}", name)
    return body


def field_path(loc) -> str:
    """pydantic's error location as a field path: ("messages", 0, "content", "str") -> "messages[0].content"
    (union member tags such as 'str' or 'list[int]' are left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in ("str", "int", "float", "bool", "list", "dict"):
            out += f".{part}" if out else part
    return out


# --- chat template ---------------------------------------------------------------------------------------------------

@dataclass
class ChatTemplate:
    template: object                 # a compiled jinja2 template
    special: dict                    # bos_token, eos_token (text)


def load_chat_template(model_dir) -> ChatTemplate | None:
    """tokenizer_config.json's chat_template (a string, or a list of {name, template}: the 'default' one)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text())
    source = cfg.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {k: token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
    return ChatTemplate(env.from_string(source), special)


def token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


def chat_prompt(chat: ChatTemplate, messages) -> str:
    """The prompt text for `messages`, ending with the generation prompt; a template error is a 400."""
    from jinja2 import TemplateError
    try:
        return chat.template.render(messages=[dict(role=m.role, content=m.text()) for m in messages],
                                    add_generation_prompt=True, **chat.special)
    except (TemplateError, ValueError) as e:
        raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from None
