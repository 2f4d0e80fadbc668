"""The Hugging Face file formats this package reads and writes, stated once.

The converters read these facts, the training code writes checkpoints with
them, and the random models of `random_models` (and the test fixtures built
on it) follow them:

- the Qwen byte-level BPE tokenizer: its pre-tokenizer Split regexes (and the
  llama.cpp pre-tokenizer that implements each), its tokenizer.json layout,
  its tokenizer_config.json with the ChatML template, its special tokens;
- the DFlash mask token (`<|MASK|>`) and how a tokenizer.json names it;
- the Qwen3.5 text config: its layer pattern and default M-RoPE sections;
- the z-lab DFlash drafter: its config.json, its default tap layers and the
  shapes of its tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "CHATML_TEMPLATE",
    "ENDOFTEXT_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "MASK_TOKEN_TEXT",
    "MASK_TOKEN_TEXTS",
    "MAX_TRAINED_CONTEXT",
    "PRE_TOKENIZERS",
    "QWEN2_PRETOKENIZE_REGEX",
    "QWEN35_PRETOKENIZE_REGEX",
    "LLAMA3_PRETOKENIZE_REGEX",
    "GPT2_PRE_TOKENIZER",
    "TRAINED_CONTEXT_KEY",
    "byte_level_bpe_tokenizer",
    "bytes_to_unicode",
    "default_mrope_section",
    "default_target_layer_ids",
    "drafter_config",
    "dflash2_tensor_shapes",
    "dspark_tensor_shapes",
    "drafter_tensor_shapes",
    "hybrid_layer_types",
    "mask_token_id_of",
    "write_tokenizer_config",
]

# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

ENDOFTEXT_TOKEN = "<|endoftext|>"   # document separator (EOS of a base model)
IM_START_TOKEN = "<|im_start|>"     # ChatML
IM_END_TOKEN = "<|im_end|>"
# The DFlash drafter's mask token as our tokenizers spell it; the converter also
# accepts the other spellings of MASK_TOKEN_TEXTS when the tokenizer names no mask.
MASK_TOKEN_TEXT = "<|MASK|>"
MASK_TOKEN_TEXTS = (MASK_TOKEN_TEXT, "<|mask|>", "<mask>", "[MASK]")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The Split regexes of Qwen's tokenizer.json files (Qwen2/Qwen3 and Qwen3.5).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3's Split regex: Qwen2's with digits in runs of up to three (llama.cpp's `llama-bpe`).
LLAMA3_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Split regex -> the llama.cpp pre-tokenizer (tokenizer.ggml.pre) that implements it.
PRE_TOKENIZERS: Mapping[str, str] = {
    QWEN2_PRETOKENIZE_REGEX: "qwen2",
    QWEN35_PRETOKENIZE_REGEX: "qwen35",
    LLAMA3_PRETOKENIZE_REGEX: "llama-bpe",
}
# A tokenizer.json whose only pre-tokenizer is ByteLevel with its own (GPT-2) regex, no Split:
# llama.cpp's `gpt-2` pre-tokenizer implements that regex.
GPT2_PRE_TOKENIZER = "gpt-2"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2 vocab order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def byte_level_bpe_tokenizer(vocab: Sequence[str], merges: Sequence[tuple[str, str]],
                             added: Sequence[Mapping[str, Any]], regex: str | None) -> dict[str, Any]:
    """tokenizer.json of a Qwen-layout byte-level BPE: NFC, the regex Split,
    ByteLevel without its own regex; `vocab` in id order, `added` tokens after it.
    `regex=None`: a GPT-2-style tokenizer instead, whose only pre-tokenizer is ByteLevel
    with its own regex."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    if regex is None:
        pre_tokenizer: dict[str, Any] = {**byte_level, "use_regex": True}
    else:
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": list(added),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab)}, "merges": [list(m) for m in merges]},
    }


def write_tokenizer_config(dst: str | os.PathLike[str], added: Sequence[Mapping[str, Any]], *, eos_token: str,
                           pad_token: str) -> None:
    """tokenizer_config.json of a Qwen-style byte-level BPE with a ChatML template."""
    tok_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    with open(Path(dst) / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tok_config, f, ensure_ascii=False, indent=2)


def mask_token_id_of(tokenizer_dir: str | os.PathLike[str]) -> int:
    """The id of `<|MASK|>` among the added tokens of `tokenizer_dir/tokenizer.json`."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"[mask_token_id_of] {path} does not exist")
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    for a in tok.get("added_tokens", []):
        if a.get("content") == MASK_TOKEN_TEXT:
            return int(a["id"])
    raise ValueError(f"[mask_token_id_of] {path} has no {MASK_TOKEN_TEXT} token")


# ---------------------------------------------------------------------------
# Qwen3.5 text config
# ---------------------------------------------------------------------------

def hybrid_layer_types(n_layer: int, full_attention_interval: int) -> list[str]:
    """Qwen3.5's `layer_types` for an interval k: layer i is full attention iff (i + 1) % k == 0."""
    k = int(full_attention_interval)
    return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(int(n_layer))]


def default_mrope_section(n_rot: int) -> list[int]:
    """Qwen3.5's `mrope_section`: the n_rot/2 rotated pairs split into interleaved
    (t, h, w) sections, ceil((n_pairs - j) / 3) each: [11, 11, 10] for n_rot 64."""
    n_pairs = n_rot // 2
    return [(n_pairs - j + 2) // 3 for j in range(3)]


# ---------------------------------------------------------------------------
# z-lab DFlash drafter
# ---------------------------------------------------------------------------

def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids` (one tap per drafter layer, spread
    from layer 1 to layer n-3; the middle layer for a one-layer drafter),
    clamped so that no id taps the target's last layer, whose HF hidden state
    is the final-normed one, and deduplicated. Tiny targets get fewer taps."""
    if n_target_layers < 2:
        raise ValueError(f"[default_target_layer_ids] a target needs >= 2 layers to be tapped, got {n_target_layers}")
    if n_draft_layers == 1:
        ids = [n_target_layers // 2]
    else:
        start, end = 1, n_target_layers - 3
        span = end - start
        ids = [int(round(start + (i * span) / (n_draft_layers - 1))) for i in range(n_draft_layers)]
    out: list[int] = []
    for i in ids:
        i = min(max(i, 0), n_target_layers - 2)
        if i not in out:
            out.append(i)
    return out


# dflash_config[TRAINED_CONTEXT_KEY] (ours; z-lab's loader ignores it): the most committed positions
# before its block the drafter attended to in training. The converter writes it to the GGUF as
# `dflash.trained_context_length`, and the engine's default drafter window is that many positions.
TRAINED_CONTEXT_KEY = "trained_context_length"
MAX_TRAINED_CONTEXT = 1 << 20   # the engine's bound (csrc/models/dflash.cpp)


def drafter_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, n_head: int,
                   n_kv: int, head_dim: int, max_position_embeddings: int, rms_norm_eps: float, rope_theta: float,
                   n_target_layers: int, mask_token_id: int, target_layer_ids: Sequence[int], block_size: int,
                   dtype: str, trained_context_length: int | None = None) -> dict[str, Any]:
    """config.json of a z-lab DFlash drafter (Qwen3 layers, full attention, non-causal);
    `trained_context_length` goes to dflash_config[TRAINED_CONTEXT_KEY] when given."""
    dflash = {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids],
              "block_size": int(block_size)}
    if trained_context_length is not None:
        dflash[TRAINED_CONTEXT_KEY] = int(trained_context_length)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": int(intermediate_size),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings),
        "rms_norm_eps": float(rms_norm_eps),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": int(num_layers),
        "layer_types": ["full_attention"] * int(num_layers),
        "num_target_layers": int(n_target_layers),
        "dflash_config": dflash,
        "dtype": dtype,
    }


def set_drafter_kind(config: dict[str, Any], kind: str, *, dflash2: Mapping[str, int], markov_rank: int,
                     where: str) -> dict[str, Any]:
    """`config` (a DFlash drafter's config.json, changed in place and returned) made a `kind`
    drafter's: "dflash2" a `DFlash2DraftModel` with dflash_config's conv / selector sizes
    (`dflash2` where not set); "dspark" a `DSparkDraftModel` (DFlash backbone) with a vanilla
    Markov head (`markov_rank` where not set) and a confidence head unless `confidence_head` is
    false; "dflash" as it is. Another kind: ValueError naming `where`."""
    if kind == "dflash2":
        config["architectures"] = ["DFlash2DraftModel"]
        config["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
        for k, v in dflash2.items():
            config["dflash_config"].setdefault(k, v)
    elif kind == "dspark":
        config["architectures"] = ["DSparkDraftModel"]
        config["auto_map"] = {"AutoModel": "dspark.DSparkDraftModel"}
        config["markov_head_type"] = "vanilla"
        config.setdefault("markov_rank", markov_rank)
        config.setdefault("confidence_head", True)
    elif kind != "dflash":
        raise ValueError(f"[{where}] unknown kind {kind!r}; expected 'dflash', 'dflash2' or 'dspark'")
    return config


def drafter_tensor_shapes(*, hidden: int, n_taps: int, n_layer: int, n_head: int, n_kv: int, head_dim: int,
                          n_ff: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name (no `model.` prefix) -> shape (row-major, PyTorch's) of every
    tensor of a z-lab DFlash drafter, in checkpoint order: `fc` (the taps'
    concatenated hidden states -> hidden), `hidden_norm`, the Qwen3 decoder
    layers, `norm`. No embed_tokens / lm_head: those are the target's."""
    h, hd = hidden, head_dim
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, n_taps * h), "hidden_norm.weight": (h,)}
    for il in range(n_layer):
        p = f"layers.{il}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (n_head * hd, h),
            p + "self_attn.k_proj.weight": (n_kv * hd, h),
            p + "self_attn.v_proj.weight": (n_kv * hd, h),
            p + "self_attn.o_proj.weight": (h, n_head * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (n_ff, h),
            p + "mlp.up_proj.weight": (n_ff, h),
            p + "mlp.down_proj.weight": (h, n_ff),
        })
    shapes["norm.weight"] = (h,)
    return shapes


def dspark_tensor_shapes(*, hidden: int, n_vocab: int, markov_rank: int,
                         confidence: bool) -> dict[str, tuple[int, ...]]:
    """The tensors a DSpark drafter (`DSparkDraftModel`, DFlash backbone) has on top of a DFlash
    drafter's, HF names as llama.cpp's converter maps them: the Markov head's previous-token
    embedding `markov_w1` [vocab, rank] and bias projection `markov_w2` [vocab, rank], and the
    optional confidence head `proj` [1, hidden + rank] with its bias [1]."""
    shapes: dict[str, tuple[int, ...]] = {"markov_head.markov_w1.weight": (n_vocab, markov_rank),
                                          "markov_head.markov_w2.weight": (n_vocab, markov_rank)}
    if confidence:
        shapes["confidence_head.proj.weight"] = (1, hidden + markov_rank)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def dflash2_tensor_shapes(*, hidden: int, n_layer: int, n_vocab: int, conv_kernel_size: int, conv_group_size: int,
                          selector_rank: int) -> dict[str, tuple[int, ...]]:
    """The tensors a DFlash 2 drafter (`DFlash2DraftModel`) has on top of a DFlash drafter's, HF
    names (no `model.` prefix) and shapes as llama.cpp's converter and loader read them: per
    layer an attention and an MLP dynamic convolution (`base_kernel` [2, K, hidden]: the input
    side's and the output side's static taps; `kernel_projection` [2 * K * hidden / group,
    hidden]: per-token taps for each channel group), and the candidate selector (token codebooks
    [vocab, rank] for the predecessor and the successor, `hidden_projection` [rank, hidden])."""
    h, k = hidden, conv_kernel_size
    projected = 2 * k * (h // conv_group_size)
    shapes: dict[str, tuple[int, ...]] = {}
    for il in range(n_layer):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{il}.{conv}.base_kernel"] = (2, k, h)
            shapes[f"layers.{il}.{conv}.kernel_projection.weight"] = (projected, h)
    shapes["candidate_selector.predecessor_codebook"] = (n_vocab, selector_rank)
    shapes["candidate_selector.successor_codebook"] = (n_vocab, selector_rank)
    shapes["candidate_selector.hidden_projection.weight"] = (selector_rank, h)
    return shapes
