"""Tokenizer over llama.cpp's own vocabulary code (through llama-cpp-python), so that
tokenization equals llama.cpp's on the same GGUF file, plus the GGUF chat template."""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

from . import _core
from ._memory import out_of_memory


class NoVocabulary(ValueError):
    """The GGUF carries no tokenizer (no tokenizer.ggml.model, or "none"): token ids still work."""


_backend_ready = False


def _llama_cpp():
    """llama_cpp with its backend initialised, its loader log at ERROR unless DFLASH_NATIVE_VERBOSE."""
    global _backend_ready
    try:
        import llama_cpp
    except ImportError as e:  # an optional extra since the wheels carry no llama-cpp-python (issue 19)
        if out_of_memory(e):
            raise MemoryError(f"[tokenizer] out of memory loading llama-cpp-python: {e}") from None
        raise ImportError(f"[tokenizer] text needs llama.cpp's vocabulary code from llama-cpp-python, which is not "
                          f"installed: pip install 'dflash-native[llama]' (token ids work without it; {e})") from None
    except (OSError, RuntimeError) as e:  # a shared library that cannot be mapped
        if out_of_memory(e):
            raise MemoryError(f"[tokenizer] out of memory loading llama-cpp-python: {e}") from None
        raise

    if not _backend_ready:
        verbose = os.environ.get("DFLASH_NATIVE_VERBOSE", "0") not in ("", "0")
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


class Tokenizer:
    """llama.cpp's vocabulary of a GGUF, loaded alone (vocab_only). The file's tokenizer metadata
    is validated first by the core's GGUF parser (_core.check_vocab): llama.cpp's loader asserts on
    some broken vocabularies, and nothing here hides stderr, so if it ever aborts it says why."""

    def __init__(self, gguf_path: str | Path):
        path = str(gguf_path)
        has_vocab, chat_template = _core.check_vocab(path)
        if not has_vocab:
            raise NoVocabulary(f"[tokenizer] '{path}' has no tokenizer vocabulary")
        self.chat_template: str | None = chat_template
        lc = self._lc = _llama_cpp()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self._model = lc.llama_model_load_from_file(path.encode("utf-8"), params)
        if not self._model:
            # llama.cpp returns NULL for any failure, a std::bad_alloc inside its loader included;
            # check_vocab has validated the file, so a NULL with little memory left is memory
            if out_of_memory():
                raise MemoryError(f"[tokenizer] out of memory loading the vocabulary of '{path}'")
            raise ValueError(f"[tokenizer] llama.cpp could not load the vocabulary of '{path}' (its log says why)")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self.eos_token_id = int(lc.llama_vocab_eos(self._vocab))
        self.bos_token_id = int(lc.llama_vocab_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}

    def __del__(self):
        model, self._model = getattr(self, "_model", None), None
        if model:
            self._lc.llama_model_free(model)

    def close(self) -> None:
        """Free llama.cpp's vocabulary now (Engine.close); idempotent."""
        self.__del__()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"[tokenizer] text must be a str, got {type(text).__name__}")
        data = text.encode("utf-8")
        n = len(data) + 8
        while True:
            buf = (self._lc.llama_token * n)()
            got = self._lc.llama_tokenize(self._vocab, data, len(data), buf, n, add_special, parse_special)
            if got >= 0:
                return list(buf[:got])
            n = -got  # too small: llama.cpp says how many it needs

    def token_bytes(self, token: int) -> bytes:
        token = int(token)
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:  # llama.cpp would abort the process (std::out_of_range)
                raise ValueError(f"[tokenizer] token id {token} is outside the vocabulary [0, {self.n_vocab})")
            n = 64
            while True:
                buf = ctypes.create_string_buffer(n)
                got = self._lc.llama_token_to_piece(self._vocab, token, buf, n, 0, True)
                if got >= 0:
                    piece = self._pieces[token] = buf.raw[:got]
                    break
                n = -got
        return piece

    def detokenize(self, tokens: Iterable[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self._lc.llama_vocab_is_eog(self._vocab, int(token)))

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"[chat] messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"[chat] message {i} must be a dict with 'role' and 'content'")
            for key in ("role", "content"):
                if not isinstance(m[key], str):
                    raise ValueError(f"[chat] message {i}: '{key}' must be a str, got {type(m[key]).__name__}")
        if not self.chat_template:
            raise ValueError("[chat] the model has no tokenizer.chat_template in its GGUF metadata")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ValueError(f"[chat] template error: {msg}")

        env.globals["raise_exception"] = raise_exception
        bos = self.token_text(self.bos_token_id) if self.bos_token_id >= 0 else ""
        eos = self.token_text(self.eos_token_id) if self.eos_token_id >= 0 else ""
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
            )
        except TemplateError as e:  # the template comes from the file: a broken one is bad input
            raise ValueError(f"[chat] tokenizer.chat_template: {type(e).__name__}: {e}") from None


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
