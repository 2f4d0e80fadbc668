"""Tokenizer metadata for the GGUF: the vocabulary, merges, token types, special token ids and
flags, the pre-tokenizer name llama.cpp knows the regex by, and the chat template, from
tokenizer.json / tokenizer_config.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import gguf
from gguf import TokenType

from ..hf_formats import GPT2_PRE_TOKENIZER, MASK_TOKEN_TEXTS, PRE_TOKENIZERS


logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# tokenizer metadata
# ---------------------------------------------------------------------------

_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _iter_pre_tokenizers(node: Any) -> Iterator[dict[str, Any]]:
    if not isinstance(node, dict):
        return
    if node.get("type") == "Sequence":
        for child in node.get("pretokenizers", []):
            yield from _iter_pre_tokenizers(child)
    else:
        yield node


def _tokenizer_pre(tok: dict[str, Any], where: Path) -> str:
    """tokenizer.ggml.pre for tokenizer.json's pre-tokenizer, as llama.cpp names the one that
    implements it: one regex Split (before a ByteLevel without its own regex) whose regex is
    Qwen2's, Qwen3.5's or Llama 3's; or a lone ByteLevel with its GPT-2 regex (`gpt-2`)."""
    pre = list(_iter_pre_tokenizers(tok.get("pre_tokenizer")))
    byte_levels = [p for p in pre if p.get("type") == "ByteLevel"]
    if not byte_levels:
        raise ValueError(f"[convert] {where}: only byte-level BPE tokenizers are supported "
                         f"(no ByteLevel pre-tokenizer)")
    if any(p.get("add_prefix_space") for p in byte_levels):
        raise ValueError(f"[convert] {where}: ByteLevel add_prefix_space=true is not supported "
                         f"(llama.cpp's byte-level BPE adds no prefix space)")
    others = sorted({str(p.get("type")) for p in pre} - {"ByteLevel", "Split"})
    if others:
        raise ValueError(f"[convert] {where}: unsupported pre-tokenizers {others}")
    splits = [p for p in pre if p.get("type") == "Split"]
    own_regex = [p for p in byte_levels if p.get("use_regex", True)]
    if not splits and len(pre) == 1 and own_regex:
        return GPT2_PRE_TOKENIZER
    if len(splits) != 1 or "Regex" not in splits[0].get("pattern", {}) or own_regex:
        raise ValueError(f"[convert] {where}: expected one regex Split pre-tokenizer and a ByteLevel without "
                         f"its own regex (or a lone GPT-2 ByteLevel), found {len(splits)} Split(s) and "
                         f"{len(own_regex)} ByteLevel(s) with use_regex")
    regex = splits[0]["pattern"]["Regex"]
    name = PRE_TOKENIZERS.get(regex)
    if name is None:
        known = ", ".join(f"{v} ({k!r})" for k, v in PRE_TOKENIZERS.items())
        raise ValueError(f"[convert] {where}: unknown pre-tokenizer regex {regex!r}; supported: {known}, "
                         f"and a lone GPT-2 ByteLevel ({GPT2_PRE_TOKENIZER})")
    return name


def _looks_special(text: str) -> bool:
    """llama.cpp's TextModel.does_token_look_special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _merge_strings(merges: Sequence[Any], where: Path) -> list[str]:
    out = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2:
            # a space inside a part is written as U+0120+... the way gguf's SpecialVocab does
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
        else:
            raise ValueError(f"[convert] {where}: unknown merges entry {m!r}")
    return out


def add_tokenizer_kv(writer: gguf.GGUFWriter, src: Path, vocab_size: int, config: Mapping[str, Any]) -> None:
    """The `tokenizer.*` keys of `src`'s tokenizer.json / tokenizer_config.json, as
    llama.cpp's converter writes them for a byte-level BPE (`gpt2` model)."""
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        logger.warning("[convert] %s: no tokenizer.json; writing a GGUF without a vocabulary", src)
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(vocab_size)
        return
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    model = tok.get("model", {}) if isinstance(tok, dict) else None
    if not isinstance(model, dict):
        raise ValueError(f"[convert] {tok_path}: 'model' must be a JSON object (the tokenizer model), got "
                         f"{str(model)[:80]}")
    if model.get("type") != "BPE":
        raise ValueError(f"[convert] {tok_path}: tokenizer model {model.get('type')!r} is not supported (BPE only)")
    pre = _tokenizer_pre(tok, tok_path)
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    tokens, types = _token_list(model, added, vocab_size, tok_path)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merge_strings(model.get("merges", []), tok_path))

    tok_config = _read_json_object(src / "tokenizer_config.json")
    if writer.arch == "llama" and isinstance(tok_config.get("add_prefix_space"), bool):
        writer.add_add_space_prefix(tok_config["add_prefix_space"])  # as llama.cpp's LlamaModel copies it
    for typ, tid in _special_token_ids(tok_config, config, added, vocab_size).items():
        getattr(writer, f"add_{typ}_token_id")(tid)
    for typ, value in _add_special_flags(tok, tok_config).items():
        getattr(writer, f"add_add_{typ}_token")(value)
    template = _chat_template(src, tok_config)
    if isinstance(template, (str, list)):
        writer.add_chat_template(template)


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_list(model: Mapping[str, Any], added: Mapping[int, Mapping[str, Any]], vocab_size: int,
                tok_path: Path) -> tuple[list[str], list[int]]:
    """Token texts and types for ids 0 .. vocab_size-1: BPE vocabulary, added tokens
    (CONTROL when special or special-looking, else USER_DEFINED), `[PAD<i>]` for unused ids."""
    id_to_text: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    for i, a in added.items():
        id_to_text[i] = a["content"]
    if id_to_text and max(id_to_text) >= vocab_size:
        raise ValueError(f"[convert] {tok_path}: token id {max(id_to_text)} >= vocab_size {vocab_size} of config.json")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        text = id_to_text.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            if added[i].get("special", False) or _looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                types.append(TokenType.USER_DEFINED)
                text = text.replace("\u2581", " ")  # llama.cpp pre-normalises user-defined spaces
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(TokenType.NORMAL)
    return tokens, types


def _special_token_ids(tok_config: Mapping[str, Any], config: Mapping[str, Any],
                       added: Mapping[int, Mapping[str, Any]], vocab_size: int) -> dict[str, int]:
    """Special ids as gguf's SpecialVocab resolves them: tokenizer_config.json's
    `<typ>_token` text looked up among the added tokens, then config.json's
    `<typ>_token_id` (also under text_config); the first valid one wins. A mask
    token with one of the usual spellings is found without either."""
    content_to_id = {a["content"]: i for i, a in sorted(added.items())}
    special_ids: dict[str, int] = {}
    for typ in _SPECIAL_TYPES:
        entry = tok_config.get(f"{typ}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text in content_to_id:
            special_ids[typ] = content_to_id[text]
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for typ in _SPECIAL_TYPES:
        tid = config.get(f"{typ}_token_id", text_config.get(f"{typ}_token_id"))
        if typ not in special_ids and isinstance(tid, int) and 0 <= tid < vocab_size:
            special_ids[typ] = tid
    if "mask" not in special_ids:
        mask = next((content_to_id[t] for t in MASK_TOKEN_TEXTS if t in content_to_id), None)
        if mask is not None:
            special_ids["mask"] = mask
    return special_ids


def _add_special_flags(tok: Mapping[str, Any], tok_config: Mapping[str, Any]) -> dict[str, bool]:
    """add_bos/add_eos/add_sep as gguf's SpecialVocab reads them: a ByteLevel post-processor adds
    nothing; a TemplateProcessing one (Llama 3: `<|begin_of_text|> $A`) adds BOS when its single
    template starts with the BOS token, EOS when it ends with the EOS token;
    tokenizer_config.json's `add_<typ>_token` overrides both."""
    def text(entry: Any) -> Any:
        return entry.get("content") if isinstance(entry, dict) else entry

    add_special: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    for proc in post.get("processors", [post]):
        if proc.get("type") == "ByteLevel":
            add_special.update(bos=False, eos=False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single") or []
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first:
                    add_special["bos"] = first == text(tok_config.get("bos_token")) or not tok_config
                if last:
                    add_special["eos"] = last == text(tok_config.get("eos_token")) or not tok_config
    for typ in ("bos", "eos", "sep"):
        value = tok_config.get(f"add_{typ}_token")
        if isinstance(value, bool):
            add_special[typ] = value
    return add_special


def _chat_template(src: Path, tok_config: Mapping[str, Any]) -> Any:
    """tokenizer_config.json's chat_template, else chat_template.jinja, else chat_template.json."""
    template = tok_config.get("chat_template")
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (src / "chat_template.json").is_file():
        template = _read_json_object(src / "chat_template.json").get("chat_template")
    return template
