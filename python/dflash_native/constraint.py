"""Structured output: constraints on the tokens generate() may produce, enforced by a grammar engine
(xgrammar, `pip install 'dflash-native[structured]'`).

    eng.generate(prompt, constraint=JsonSchema({"type": "object", ...}))   # or a schema dict itself
    eng.generate(prompt, constraint=JsonSchema())                          # any JSON object
    eng.generate(prompt, constraint=Regex(r"\\d{3}-\\d{4}"))
    eng.generate(prompt, constraint=Grammar('root ::= "yes" | "no"'))      # xgrammar's EBNF (GBNF)

The core masks every logits row it chooses a token from (AR steps, every verify row, every draft)
with the grammar's bitmask at that point (csrc/constraint.h), so constrained speculative output is
constrained AR output, bit for bit. The grammar ends the generation by allowing only the end-of-
generation tokens once it is complete; max_tokens may cut it short first (stop_reason "length").

The vocabulary the grammar engine sees is the GGUF's own (the package's tokenizer): each token's
bytes as llama.cpp renders them, control tokens (BOS, chat markers) as never-allowed specials, and
the end-of-generation tokens as the stop tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Union

import numpy as np

from . import _core


@dataclass(frozen=True)
class JsonSchema:
    """Output that is one JSON value valid under `schema` (a dict, or its JSON text); None: any
    JSON object (OpenAI's response_format {"type": "json_object"}). Compact JSON: no whitespace
    outside strings (so a small model cannot loop on blanks). Objects allow no properties beyond
    those the schema lists unless it says additionalProperties (xgrammar's strict mode)."""

    schema: dict | str | None = None
    # literal text before and after the JSON value (the server's forced tool call: a chat format's
    # call markers around the call's JSON, tools.ToolParser.CALL_OPEN / CALL_CLOSE)
    begin: str = ""
    end: str = ""


@dataclass(frozen=True)
class Regex:
    """Output that matches the regular expression `pattern` (the whole output)."""

    pattern: str


@dataclass(frozen=True)
class Grammar:
    """Output that the EBNF grammar `ebnf` (xgrammar's / llama.cpp's GBNF form, rule `root`) derives."""

    ebnf: str


Constraint = Union[JsonSchema, Regex, Grammar]


def as_constraint(value) -> Constraint | None:
    """generate()'s constraint argument checked: None, a JsonSchema / Regex / Grammar, or a JSON
    schema as a dict (JsonSchema(value))."""
    if value is None or isinstance(value, (JsonSchema, Regex, Grammar)):
        c = value
    elif isinstance(value, dict):
        c = JsonSchema(value)
    else:
        raise ValueError(f"[constraint] constraint must be None, a JsonSchema, Regex or Grammar, or a JSON schema "
                         f"dict; got {type(value).__name__}")
    if isinstance(c, JsonSchema) and not isinstance(c.schema, (dict, str, type(None))):
        raise ValueError(f"[constraint] JsonSchema.schema must be a dict, a JSON str or None, got "
                         f"{type(c.schema).__name__}")
    if isinstance(c, JsonSchema) and not (isinstance(c.begin, str) and isinstance(c.end, str)):
        raise ValueError("[constraint] JsonSchema.begin and .end must be str")
    if isinstance(c, Regex) and not isinstance(c.pattern, str):
        raise ValueError(f"[constraint] Regex.pattern must be a str, got {type(c.pattern).__name__}")
    if isinstance(c, Grammar) and not isinstance(c.ebnf, str):
        raise ValueError(f"[constraint] Grammar.ebnf must be a str, got {type(c.ebnf).__name__}")
    return c


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("[constraint] structured output needs the grammar engine xgrammar: "
                          "pip install 'dflash-native[structured]'") from None
    return xgrammar


class GrammarEngine:
    """One vocabulary's grammar compiler: xgrammar's TokenizerInfo built from the GGUF vocabulary
    (Tokenizer) and n_vocab (the model's embedding rows: ids past the tokenizer's are padding,
    never allowed), with its compiled-grammar cache. Thread-safe."""

    def __init__(self, tokenizer, n_vocab: int):
        xgr = _xgrammar()
        n = tokenizer.n_vocab
        vocab = [b"" if tokenizer.is_control(t) else tokenizer.token_bytes(t) for t in range(n)]
        stops = [t for t in range(n) if tokenizer.is_eog(t)]
        if not stops:
            raise ValueError("[constraint] the vocabulary has no end-of-generation token to end a grammar with")
        self.n_vocab = n_vocab
        self._info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self._info)
        self._lock = threading.Lock()

    def compile(self, c: Constraint):
        """The compiled grammar of c; ValueError naming what the grammar engine could not compile."""
        c = as_constraint(c)
        if isinstance(c, JsonSchema):
            what = "JSON schema"
            text = c.schema if isinstance(c.schema, str) or c.schema is None else _schema_text(c.schema)
        else:
            what, text = ("regex", c.pattern) if isinstance(c, Regex) else ("grammar", c.ebnf)
        try:
            with self._lock:
                if isinstance(c, JsonSchema):
                    strict = c.schema is not None
                    text = text if strict else '{"type": "object"}'
                    if not (c.begin or c.end):
                        return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=strict)
                    xgr = _xgrammar()
                    parts = [xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict)]
                    parts = [_literal(xgr, c.begin)] * bool(c.begin) + parts + [_literal(xgr, c.end)] * bool(c.end)
                    return self._compiler.compile_grammar(xgr.Grammar.concat(*parts))
                if isinstance(c, Regex):
                    return self._compiler.compile_regex(text)
                return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"[constraint] cannot compile the {what}: {_message(e)}") from None

    def matcher(self, c: Constraint) -> "Matcher":
        return Matcher(self.compile(c))


def _literal(xgr, text: str):
    """The grammar of exactly `text` (an EBNF string literal: JSON's escapes are EBNF's)."""
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _schema_text(schema: dict) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"[constraint] the JSON schema is not JSON: {e}") from None


def _message(e: Exception) -> str:
    """xgrammar's error text without its '[time] file.cc:line: ' prefix and 'Check failed' noise."""
    s = str(e).strip()
    s = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", s)
    s = re.sub(r"^Check failed: \(.*?\) is false: ", "", s)
    return s.splitlines()[0] if s else type(e).__name__


class Matcher(_core.Constraint):
    """One request's grammar state (csrc/constraint.h's token_constraint over xgrammar's
    GrammarMatcher): the core calls fill_mask / accept / rollback / terminated during its steps.
    mask_s and n_masks: seconds in the grammar engine (masks, accepts, rollbacks) and masks made."""

    def __init__(self, compiled):
        super().__init__()
        self._m = _xgrammar().GrammarMatcher(compiled)
        # tokens the mask never allows: the core may offer one to accept() without a mask
        # (constraint.h), which xgrammar rejects with a warning on stderr; rejected here quietly
        info = compiled.tokenizer_info
        self._never = frozenset(info.special_token_ids)
        self._n_vocab = info.vocab_size
        self.mask_s = 0.0
        self.n_masks = 0

    def fill_mask(self, mask: np.ndarray) -> None:  # int32 [ceil(n_vocab / 32)], the core's buffer
        t0 = time.perf_counter()
        if self._m.is_terminated():
            mask[:] = 0
        else:
            self._m.fill_next_token_bitmask(mask.reshape(1, -1))
        self.n_masks += 1
        self.mask_s += time.perf_counter() - t0

    def accept(self, token: int) -> bool:
        t0 = time.perf_counter()
        ok = 0 <= token < self._n_vocab and token not in self._never and self._m.accept_token(token)
        self.mask_s += time.perf_counter() - t0
        return ok

    def rollback(self, n: int) -> None:
        if n > 0:
            t0 = time.perf_counter()
            self._m.rollback(int(n))
            self.mask_s += time.perf_counter() - t0

    def terminated(self) -> bool:
        return self._m.is_terminated()
