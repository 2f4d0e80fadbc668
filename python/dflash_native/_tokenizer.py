"""Tokenizer over llama.cpp's own vocabulary code (through llama-cpp-python), so that
tokenization equals llama.cpp's on the same GGUF file, plus the GGUF chat template."""

from __future__ import annotations

import codecs
import contextlib
import os
from pathlib import Path
from typing import Iterable, Sequence

from ._memory import out_of_memory


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp prints its loader log on fd 2 even with verbose=False for some messages."""
    if os.environ.get("DFLASH_NATIVE_VERBOSE"):
        yield
        return
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


class Tokenizer:
    def __init__(self, gguf_path: str | Path):
        try:
            import llama_cpp
        except (ImportError, OSError, RuntimeError) as e:  # a shared library that cannot be mapped
            if out_of_memory(e):
                raise MemoryError(f"[tokenizer] out of memory loading llama-cpp-python: {e}") from None
            raise

        self._lc = llama_cpp
        with _quiet_stderr():
            try:
                self._llama = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
            except Exception as e:  # llama-cpp-python raises ValueError("Failed to load model from file")
                if out_of_memory(e):
                    raise MemoryError(f"[tokenizer] out of memory loading the vocabulary of '{gguf_path}' "
                                      f"(llama.cpp: {e})") from None
                raise ValueError(f"[tokenizer] llama.cpp could not load the vocabulary of '{gguf_path}': {e}") from None
        self._vocab = self._llama._model.vocab
        self.metadata: dict[str, str] = dict(self._llama.metadata)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        if self.n_vocab <= 0:
            raise ValueError(f"[tokenizer] '{gguf_path}' has no tokenizer vocabulary")
        self.eos_token_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.bos_token_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"[tokenizer] text must be str, got {type(text).__name__}")
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def token_bytes(self, token: int) -> bytes:
        return self._llama.detokenize([int(token)], special=True)

    def detokenize(self, tokens: Iterable[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self._vocab, int(token)))

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("[chat] the model has no tokenizer.chat_template in its GGUF metadata")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ValueError(f"[chat] template error: {msg}")

        env.globals["raise_exception"] = raise_exception
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"[chat] message {i} must be a dict with 'role' and 'content'")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id >= 0 else ""
        eos = self.token_text(self.eos_token_id) if self.eos_token_id >= 0 else ""
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )


class StreamDecoder:
    """Turns tokens into text pieces without splitting UTF-8 sequences across tokens."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
