"""Tokenizer over llama.cpp's own vocabulary code (libllama, linked by the C++ core: csrc/gguf/tokenizer.h),
so that tokenization equals llama.cpp's on the same GGUF file, plus the GGUF chat template."""

from __future__ import annotations

import codecs
import functools
from pathlib import Path
from typing import Iterable, Sequence

from . import _core
from ._memory import out_of_memory


class NoVocabulary(ValueError):
    """The GGUF carries no tokenizer (no tokenizer.ggml.model, or "none"): token ids still work."""


class Tokenizer:
    """llama.cpp's vocabulary of a GGUF, loaded alone (vocab_only) by the core. The file's tokenizer
    metadata is validated first by the core's GGUF parser (csrc/gguf/vocab.h): llama.cpp's loader
    asserts on some broken vocabularies."""

    def __init__(self, gguf_path: str | Path):
        path = str(gguf_path)
        try:
            core = _core.Tokenizer.load(path)
        except ValueError as e:
            # llama.cpp returns NULL for any failure, a std::bad_alloc inside its loader included
            if "llama.cpp could not load" in str(e) and out_of_memory():
                raise MemoryError(f"[tokenizer] out of memory loading the vocabulary of '{path}'") from None
            raise
        if core is None:
            raise NoVocabulary(f"[tokenizer] '{path}' has no tokenizer vocabulary")
        self._core = core
        self.chat_template: str | None = core.chat_template
        self.n_vocab = int(core.n_vocab)
        self.eos_token_id = int(core.eos_token_id)
        self.bos_token_id = int(core.bos_token_id)
        self._pieces: dict[int, bytes] = {}

    def close(self) -> None:
        """Free llama.cpp's vocabulary now (Engine.close); idempotent."""
        self._core = None

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"[tokenizer] text must be a str, got {type(text).__name__}")
        return self._live().tokenize(text.encode("utf-8"), add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        token = int(token)
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:  # also keeps ids past int32 from pybind11's TypeError
                raise ValueError(f"[tokenizer] token id {token} is outside the vocabulary [0, {self.n_vocab})")
            piece = self._pieces[token] = self._live().piece(token)
        return piece

    def _live(self):
        core = self._core
        if core is None:
            raise RuntimeError("[tokenizer] this Tokenizer is closed")
        return core

    def detokenize(self, tokens: Iterable[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self._live().is_eog(int(token)))

    def is_control(self, token: int) -> bool:
        """A control token (BOS, EOS, chat markers): rendered by token_bytes, but never text."""
        return 0 <= token < self.n_vocab and bool(self._live().is_control(int(token)))

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None) -> str:
        """The GGUF's chat template rendered as transformers' apply_chat_template renders it (its
        jinja environment: tojson without HTML escaping, loop controls, strftime_now): `messages`
        are dicts with a str 'role' and 'content' (an assistant's 'tool_calls', a tool message's
        'tool_call_id' as HF templates read them), `tools` JSON schemas of functions
        ({"type": "function", "function": {...}}) or None."""
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"[chat] messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"[chat] message {i} must be a dict with 'role' and 'content'")
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise ValueError(f"[chat] message {i}: '{key}' must be a str, got {type(m[key]).__name__}")
        if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"[chat] tools must be a list of dicts, got {tools!r}"[:200])
        if not self.chat_template:
            raise ValueError("[chat] the model has no tokenizer.chat_template in its GGUF metadata")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id >= 0 else ""
        eos = self.token_text(self.eos_token_id) if self.eos_token_id >= 0 else ""
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, bos_token=bos, eos_token=eos)


def render_chat_template(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                         tools: Sequence[dict] | None = None, bos_token: str = "", eos_token: str = "") -> str:
    """A chat template's text rendered with the variables transformers gives it (messages, tools,
    documents=None, add_generation_prompt, the special tokens); a template error is a ValueError."""
    from jinja2 import TemplateError

    try:
        return _jinja_env().from_string(template).render(
            messages=list(messages), tools=None if tools is None else list(tools), documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:  # the template comes from the file: a broken one is bad input
        raise ValueError(f"[chat] tokenizer.chat_template: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=1)
def _jinja_env():
    """A sandboxed jinja2 environment with what transformers gives chat templates."""
    import json
    from datetime import datetime

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(msg):
        raise ValueError(f"[chat] template error: {msg}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class StreamDecoder:
    """Turns tokens into text pieces without splitting UTF-8 sequences across tokens."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if not 0 <= token < self._tok.n_vocab:
            return ""  # an embedding row past the tokenizer's vocabulary (padding) has no text
        return self._dec.decode(self._tok.token_bytes(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
