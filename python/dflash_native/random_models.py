"""Random-weight checkpoints of real shapes: the models of `dflash-native demo --random`
and stand-ins of any size for benchmarks (NumPy only).

`make_random_checkpoint` writes a Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that transformers
loads with `AutoModelForCausalLM.from_pretrained` and `convert_hf_to_gguf`
converts: a Llama (`LlamaForCausalLM`), Qwen3 (`Qwen3ForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`), Qwen3.5 text (`Qwen3_5ForCausalLM`, `qwen3_5_text`),
Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) or Qwen3-Next (`Qwen3NextForCausalLM`) model with random weights at a scale that keeps logits
informative and long decodes stable. `make_random_drafter_checkpoint` writes a
z-lab DFlash drafter (`DFlashDraftModel`), and `make_random_drafter_gguf`
one that matches a target, converted with `convert_dflash_to_gguf`.

Defaults are tiny (hidden 64, 2-4 layers). Every config key can be
overridden, and `vocab_size` may exceed the tokenizer's size (the extra ids
are unused padding), so a benchmark can build a full-size shape. The
tokenizer is a byte-level BPE in the Qwen layout (hf_formats) over the 256
byte symbols plus merges learned from a text (`learn_bpe`; by default the
Python source of the standard library's posixpath module), then SPECIAL_TOKENS.

Weights depend only on (seed, tensor name, shape): linear weights
N(0, 0.5/sqrt(fan_in)), the residual output projections shrinking with depth,
embeddings N(0, 1) / sqrt(hidden) * 2, norm weights near their neutral value.

Over 600 lines as one recipe: the targets' and drafters' configs, their weights under the one
scale policy above, and the tokenizer they carry must stay in step (a drafter matches its
target's shapes and vocabulary), so they are written in one place.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import tempfile
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .hf_formats import (
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    LLAMA3_PRETOKENIZE_REGEX,
    MASK_TOKEN_TEXT,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN35_PRETOKENIZE_REGEX,
    byte_level_bpe_tokenizer,
    bytes_to_unicode,
    default_mrope_section,
    default_target_layer_ids,
    drafter_config,
    dflash2_tensor_shapes,
    drafter_tensor_shapes,
    dspark_tensor_shapes,
    hybrid_layer_types,
    mask_token_id_of,
    set_drafter_kind,
    write_tokenizer_config,
)

__all__ = [
    "SPECIAL_TOKENS",
    "drafter_overrides_for_target",
    "default_merges",
    "learn_bpe",
    "make_random_checkpoint",
    "make_random_drafter_checkpoint",
    "make_random_drafter_gguf",
    "make_random_gguf",
    "target_config",
    "target_weights",
    "write_safetensors",
    "write_tokenizer",
]

# Added tokens, in id order after the BPE vocabulary: (text, special).
SPECIAL_TOKENS: Sequence[tuple[str, bool]] = (
    (ENDOFTEXT_TOKEN, True),
    (IM_START_TOKEN, True),
    (IM_END_TOKEN, True),
    (MASK_TOKEN_TEXT, True),
    ("<think>", False),
    ("</think>", False),
)

_BASE_CONFIG: Mapping[str, Mapping[str, Any]] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 640,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_cache": True,
    },
    "qwen3_5": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 640,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "full_attention_interval": 2,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
}

# Llama, and the MoE archs: Qwen3's / Qwen3.5's layers with routed experts (and for Qwen3.5-MoE a shared expert)
# in place of the dense FFN.
_BASE_CONFIG = {**_BASE_CONFIG, "llama": {  # Llama 3.x: no q/k norms (target_weights), its own RoPE base
    **_BASE_CONFIG["qwen3"],
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "mlp_bias": False,
    "tie_word_embeddings": False,
}, "qwen3_moe": {
    **_BASE_CONFIG["qwen3"],
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}, "qwen3_5_moe": {
    **{k: v for k, v in _BASE_CONFIG["qwen3_5"].items() if k != "intermediate_size"},
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}, "qwen3_next": {  # Qwen3-Next: Qwen3.5's hybrid with fused GDN projections, NeoX partial RoPE, MoE
    **{k: v for k, v in _BASE_CONFIG["qwen3_5"].items() if k not in ("rope_parameters",)},
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}}

_ARCH_ALIASES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3moe": "qwen3_moe",
                 "qwen3_5": "qwen3_5", "qwen35": "qwen3_5", "qwen3_5_text": "qwen3_5",
                 "qwen3_5_moe": "qwen3_5_moe", "qwen35moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
                 "qwen3_next": "qwen3_next", "qwen3next": "qwen3_next"}
_PRETOKENIZE_REGEX = {"llama": LLAMA3_PRETOKENIZE_REGEX, "qwen3": QWEN2_PRETOKENIZE_REGEX,
                      "qwen3_moe": QWEN2_PRETOKENIZE_REGEX,
                      "qwen3_5": QWEN35_PRETOKENIZE_REGEX, "qwen3_5_moe": QWEN35_PRETOKENIZE_REGEX,
                      "qwen3_next": QWEN2_PRETOKENIZE_REGEX}

# safetensors dtype name -> (header dtype, bytes per element)
ST_DTYPES: Mapping[str, tuple[str, int]] = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}

# name -> (shape, init, seed name): the seed name picks the random stream, so a
# tensor renamed by another layout keeps its values
WeightSpecs = dict[str, tuple[tuple[int, ...], tuple, str]]


# ---------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------

def canonical_arch(arch: str) -> str:
    """"llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe" or "qwen3_next" for any accepted spelling; ValueError
    otherwise."""
    out = _ARCH_ALIASES.get(arch)
    if out is None:
        raise ValueError(f"[make_random_checkpoint] unknown arch {arch!r}; expected one of {sorted(_BASE_CONFIG)}")
    return out


def make_random_checkpoint(dst_dir: str | os.PathLike[str], arch: str = "qwen3_5", *, seed: int = 0,
                           dtype: str = "float32", merges: Sequence[tuple[str, str]] | None = None,
                           **config_overrides: Any) -> Path:
    """Write a random HF checkpoint of `arch` ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3", "qwen3_moe" or
    "llama")
    to `dst_dir`.

    `config_overrides` replace config.json keys. `dtype` is the safetensors
    dtype ("float32", "bfloat16", "float16"). `merges`: the tokenizer's BPE
    merges in priority order, as many as fit the vocabulary (default:
    `default_merges()`; llama.cpp's BPE loader needs at least one).
    """
    arch = canonical_arch(arch)
    if merges is None:
        merges = default_merges()
    if dtype not in ST_DTYPES:
        raise ValueError(f"[make_random_checkpoint] unknown dtype {dtype!r}; expected one of {sorted(ST_DTYPES)}")
    cfg = target_config(arch, config_overrides)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    special_ids = write_tokenizer(dst, vocab_size=cfg["vocab_size"], regex=_PRETOKENIZE_REGEX[arch], merges=merges)
    cfg["bos_token_id"] = special_ids[ENDOFTEXT_TOKEN]
    cfg["eos_token_id"] = special_ids[IM_END_TOKEN]
    cfg["pad_token_id"] = special_ids[ENDOFTEXT_TOKEN]
    cfg["dtype"] = dtype
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    write_weights(dst, target_weights(arch, cfg), seed=seed, dtype=dtype)
    return dst


def make_random_gguf(dst_path: str | os.PathLike[str], arch: str = "qwen3_5", *, outtype: str = "f16",
                     seed: int = 0, **overrides: Any) -> Path:
    """`make_random_checkpoint` into a temporary directory, then `convert_hf_to_gguf`."""
    from .convert import convert_hf_to_gguf

    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        ckpt = make_random_checkpoint(tmp, arch, seed=seed, **overrides)
        return convert_hf_to_gguf(ckpt, dst_path, outtype=outtype)


def target_config(arch: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The text config.json of a random `arch` target, without token ids."""
    cfg = json.loads(json.dumps(_BASE_CONFIG[arch]))
    cfg.update(json.loads(json.dumps(dict(overrides))))
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        rp = cfg["rope_parameters"]
        if "mrope_section" not in rp and arch != "qwen3_next":
            rp["mrope_section"] = default_mrope_section(int(cfg["head_dim"] * rp.get("partial_rotary_factor", 0.25)))
        if "layer_types" not in overrides:
            cfg["layer_types"] = hybrid_layer_types(cfg["num_hidden_layers"], cfg["full_attention_interval"])
        elif "full_attention_interval" not in overrides:
            cfg.pop("full_attention_interval", None)
    cfg.setdefault("initializer_range", 0.5 / math.sqrt(cfg["hidden_size"]))
    return cfg


def target_weights(arch: str, cfg: Mapping[str, Any]) -> WeightSpecs:
    """name -> (shape, init, seed name) of a random `arch` target, in checkpoint order.

    Linear weights are N(0, 0.5/sqrt(fan_in)) so each projection shrinks its
    input a little and the residual stream stays O(1) at any width; embeddings
    are N(0, 1) / sqrt(hidden) * 2 so logits have a spread of a few units.
    Norm weights sit near their neutral value (1, or 0 for Qwen3.5's 1 + w form).
    """
    h = int(cfg["hidden_size"])
    n_vocab = int(cfg["vocab_size"])
    n_head, n_kv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    hybrid = arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    centered = hybrid  # Qwen3.5 / Qwen3-Next RMSNorm computes x * (1 + w)
    norm = ("normal", 0.1) if centered else ("one_plus", 0.1)
    # Output projections of the residual branches shrink with depth (GPT-2 style)
    # so that deep shapes stay as well-conditioned as the tiny ones.
    depth_scale = math.sqrt(min(1.0, 4.0 / int(cfg["num_hidden_layers"])))

    p: dict[str, tuple[tuple[int, ...], tuple]] = {}
    p["model.embed_tokens.weight"] = ((n_vocab, h), ("normal", 2.0 / math.sqrt(h)))
    layer_types = cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"])
    for il in range(int(cfg["num_hidden_layers"])):
        pre = f"model.layers.{il}."
        p[pre + "input_layernorm.weight"] = ((h,), norm)
        if hybrid and layer_types[il] == "linear_attention":
            _gdn_params(p, pre + "linear_attn.", cfg, depth_scale, fused=arch == "qwen3_next")
        else:
            q_out = n_head * hd * (2 if hybrid else 1)  # Qwen3.5: per head [q | gate]
            s = pre + "self_attn."
            p[s + "q_proj.weight"] = _linear_init(q_out, h)
            p[s + "k_proj.weight"] = _linear_init(n_kv * hd, h)
            p[s + "v_proj.weight"] = _linear_init(n_kv * hd, h)
            p[s + "o_proj.weight"] = _linear_init(h, n_head * hd, depth_scale)
            if arch != "llama":  # Llama has no q/k RMSNorm
                p[s + "q_norm.weight"] = ((hd,), norm)
                p[s + "k_norm.weight"] = ((hd,), norm)
        p[pre + "post_attention_layernorm.weight"] = ((h,), norm)
        if arch in ("qwen3_moe", "qwen3_5_moe", "qwen3_next"):
            _moe_params(p, pre + "mlp.", cfg, depth_scale)
            continue
        ff = int(cfg["intermediate_size"])
        p[pre + "mlp.gate_proj.weight"] = _linear_init(ff, h)
        p[pre + "mlp.up_proj.weight"] = _linear_init(ff, h)
        p[pre + "mlp.down_proj.weight"] = _linear_init(h, ff, depth_scale)
    p["model.norm.weight"] = ((h,), norm)
    if not cfg["tie_word_embeddings"]:
        p["lm_head.weight"] = ((n_vocab, h), ("normal", 2.0 / math.sqrt(h)))
    return {name: (shape, init, name) for name, (shape, init) in p.items()}


def _moe_params(p: dict, m: str, cfg: Mapping[str, Any], depth_scale: float) -> None:
    """A routed-experts FFN (prefix `m`) in the hub layout (router `gate`, per-expert projections)
    into p: name -> (shape, init). The router is wide (std 2/sqrt(hidden)) so that tokens disagree
    on their experts."""
    h, n_ff = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    p[m + "gate.weight"] = ((int(cfg["num_experts"]), h), ("normal", 2.0 / math.sqrt(h)))
    for e in range(int(cfg["num_experts"])):
        x = f"{m}experts.{e}."
        p[x + "gate_proj.weight"] = _linear_init(n_ff, h)
        p[x + "up_proj.weight"] = _linear_init(n_ff, h)
        p[x + "down_proj.weight"] = _linear_init(h, n_ff, depth_scale)
    if "shared_expert_intermediate_size" in cfg:  # Qwen3.5-MoE / Qwen3-Next: a gated shared expert
        n_sh = int(cfg["shared_expert_intermediate_size"])
        p[m + "shared_expert.gate_proj.weight"] = _linear_init(n_sh, h)
        p[m + "shared_expert.up_proj.weight"] = _linear_init(n_sh, h)
        p[m + "shared_expert.down_proj.weight"] = _linear_init(h, n_sh, depth_scale)
        p[m + "shared_expert_gate.weight"] = _linear_init(1, h)


def _gdn_params(p: dict, a: str, cfg: Mapping[str, Any], depth_scale: float, fused: bool = False) -> None:
    """A Gated DeltaNet mixer (prefix `a`) into p: name -> (shape, init). Qwen3.5's projections
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), or with `fused` Qwen3-Next's (in_proj_qkvz,
    in_proj_ba: rows per key head, same init)."""
    h = int(cfg["hidden_size"])
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    kernel = int(cfg["linear_conv_kernel_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    if fused:
        p[a + "in_proj_qkvz.weight"] = _linear_init(conv_dim + nv * dv, h)
        p[a + "in_proj_ba.weight"] = _linear_init(2 * nv, h)
    else:
        p[a + "in_proj_qkv.weight"] = _linear_init(conv_dim, h)
        p[a + "in_proj_z.weight"] = _linear_init(nv * dv, h)
        p[a + "in_proj_b.weight"] = _linear_init(nv, h)
        p[a + "in_proj_a.weight"] = _linear_init(nv, h)
    p[a + "conv1d.weight"] = ((conv_dim, 1, kernel), ("normal", 1.0 / math.sqrt(kernel)))
    p[a + "dt_bias"] = ((nv,), ("uniform", -1.0, 1.0))
    p[a + "A_log"] = ((nv,), ("log_uniform", 0.5, 8.0))  # decay rate A in [0.5, 8]
    p[a + "norm.weight"] = ((dv,), ("one_plus", 0.1))     # gated norm: plain x * w
    p[a + "out_proj.weight"] = _linear_init(h, nv * dv, depth_scale)


def _linear_init(n_out: int, n_in: int, scale: float = 1.0) -> tuple[tuple[int, int], tuple]:
    """(shape, init) of a random linear layer, std 0.5 / sqrt(n_in) (times `scale`)."""
    return (n_out, n_in), ("normal", scale * 0.5 / math.sqrt(n_in))


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

def write_tokenizer(dst: Path, *, vocab_size: int | None, regex: str | None,
                    merges: Sequence[tuple[str, str]] = ()) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json: the 256 byte symbols, as
    many of `merges` as fit `vocab_size`, then SPECIAL_TOKENS. Returns the
    added tokens' ids by text."""
    if vocab_size is not None:
        room = vocab_size - 256 - len(SPECIAL_TOKENS)
        if room < 0:
            raise ValueError(f"[make_random_checkpoint] vocab_size {vocab_size} < 256 byte tokens + "
                             f"{len(SPECIAL_TOKENS)} added tokens")
        merges = merges[:room]
    vocab = list(bytes_to_unicode().values())
    seen = set(vocab)
    for a, b in merges:  # a merge adds its result unless an earlier one made the same string
        if a + b not in seen:
            seen.add(a + b)
            vocab.append(a + b)
    added = [{"id": len(vocab) + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": special} for i, (text, special) in enumerate(SPECIAL_TOKENS)]
    with open(Path(dst) / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(byte_level_bpe_tokenizer(vocab, merges, added, regex), f, ensure_ascii=False)
    write_tokenizer_config(dst, added, eos_token=IM_END_TOKEN, pad_token=ENDOFTEXT_TOKEN)
    return {a["content"]: a["id"] for a in added}


# An approximation of the Qwen split with the stdlib `re`: it only shapes the
# training words; encoding uses the exact regex in tokenizer.json.
_TRAIN_SPLIT = re.compile(r"""'(?:[sdmt]|ll|ve|re)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
DEFAULT_MERGES = 300


@functools.lru_cache(maxsize=1)
def default_merges() -> tuple[tuple[str, str], ...]:
    """DEFAULT_MERGES merges learned from the source of the standard library's posixpath
    (what the random demo's prompt comes from): any text gives a working tokenizer."""
    import posixpath

    return learn_bpe(Path(posixpath.__file__).read_text(encoding="utf-8"), DEFAULT_MERGES)


def learn_bpe(text: str, n_merges: int) -> tuple[tuple[str, str], ...]:
    """The first `n_merges` byte-level BPE merges of `text`, in priority order (fewer
    if no pair occurs twice); ties go to the larger pair. Greedy, so the first k
    merges are the merges of n_merges = k."""
    byte_map = bytes_to_unicode()
    word_counts = Counter(_TRAIN_SPLIT.findall(text))
    words: list[list[str]] = [[byte_map[b] for b in w.encode("utf-8")] for w in word_counts]
    freqs: list[int] = list(word_counts.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)  # pair -> words it occurs in
    for wi, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += freqs[wi]
            where[pair].add(wi)

    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges and pair_counts:
        best, count = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        merges.append(best)
        for wi in sorted(where.pop(best, ())):
            _merge_in_word(words, wi, freqs[wi], best, pair_counts, where)
        pair_counts.pop(best, None)
    return tuple(merges)


def _merge_in_word(words: list[list[str]], wi: int, freq: int, best: tuple[str, str],
                   pair_counts: Counter[tuple[str, str]], where: defaultdict[tuple[str, str], set[int]]) -> None:
    """Apply merge `best` to word `wi`, moving its pair counts from the old symbols to the new."""
    w = words[wi]
    for pair in zip(w, w[1:]):
        pair_counts[pair] -= freq
        if pair_counts[pair] <= 0:
            del pair_counts[pair]
    merged = best[0] + best[1]
    out: list[str] = []
    i = 0
    while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best:
            out.append(merged)
            i += 2
        else:
            out.append(w[i])
            i += 1
    words[wi] = out
    for pair in zip(out, out[1:]):
        pair_counts[pair] += freq
        where[pair].add(wi)


# ---------------------------------------------------------------------------
# weights and safetensors writing
# ---------------------------------------------------------------------------

def _init_tensor(seed: int, seed_name: str, shape: tuple[int, ...], init: tuple) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(seed_name.encode())])
    kind = init[0]
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(init[1])
    if kind == "one_plus":
        return np.float32(1.0) + rng.standard_normal(shape, dtype=np.float32) * np.float32(init[1])
    if kind == "uniform":
        return rng.uniform(init[1], init[2], size=shape).astype(np.float32)
    if kind == "log_uniform":
        return np.log(rng.uniform(init[1], init[2], size=shape)).astype(np.float32)
    raise AssertionError(kind)


def _to_bytes(x: np.ndarray, dtype: str) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.astype("<f4").tobytes()
    if dtype == "float16":
        return x.astype("<f2").tobytes()
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)  # nearest even
    return rounded.astype("<u2").tobytes()


def write_safetensors(path: Path, weights: WeightSpecs, *, seed: int, dtype: str) -> int:
    """Stream random tensors into one .safetensors file; returns the data size in bytes."""
    st_dtype, itemsize = ST_DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, _, _) in weights.items():
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for shape, init, seed_name in weights.values():
            f.write(_to_bytes(_init_tensor(seed, seed_name, shape, init), dtype))
    return offset


def remove_weights(dst: Path) -> None:
    """Delete the safetensors files (and index) a previous checkpoint left in `dst`."""
    for stale in list(dst.glob("model*.safetensors")) + [dst / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)


def write_weights(dst: Path, weights: WeightSpecs, *, seed: int, dtype: str) -> None:
    """`dst`/model.safetensors, replacing any weights already there."""
    remove_weights(dst)
    write_safetensors(dst / "model.safetensors", weights, seed=seed, dtype=dtype)


# ---------------------------------------------------------------------------
# DFlash drafters
# ---------------------------------------------------------------------------

def make_random_drafter_checkpoint(dst_dir: str | os.PathLike[str], *, hidden_size: int, n_target_layers: int,
                                   mask_token_id: int, vocab_size: int, target_layer_ids: list[int] | None = None,
                                   num_hidden_layers: int = 1, block_size: int = 16, seed: int = 0,
                                   dtype: str = "float32", prefix: str = "", kind: str = "dflash",
                                   **overrides: Any) -> Path:
    """Write a random z-lab style DFlash drafter checkpoint to `dst_dir`.

    `kind="dflash2"` writes a `DFlash2DraftModel`: dflash_config gets DFLASH2_DEFAULTS (the
    dynamic convolutions' kernel and group sizes, the selector's rank and top-k; overridable
    through `dflash_config`) and the weights its convolutions and selector
    (hf_formats.dflash2_tensor_shapes). `kind="dspark"` writes a `DSparkDraftModel` (DFlash
    backbone): a vanilla Markov head of config `markov_rank` (default DSPARK_MARKOV_RANK) and,
    unless config `confidence_head` is false, a confidence head (hf_formats.dspark_tensor_shapes);
    a `sample_from_anchor` override goes to config.json as it is.

    `overrides` replace config.json keys; a `dflash_config` override is merged
    into the generated one. `prefix="model."` writes tensor names with the
    prefix some exports use. `dtype` is the safetensors dtype. The attention
    shape defaults to 4 query heads, 2 KV heads, head_dim hidden/4.
    """
    if dtype not in ST_DTYPES:
        raise ValueError(f"[make_random_drafter_checkpoint] unknown dtype {dtype!r}; expected one of "
                         f"{tuple(ST_DTYPES)}")
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_target_layers, num_hidden_layers)
    h = int(hidden_size)
    config = drafter_config(vocab_size=vocab_size, hidden_size=h, intermediate_size=2 * h,
                            num_layers=num_hidden_layers, n_head=4, n_kv=2, head_dim=max(1, h // 4),
                            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            n_target_layers=n_target_layers, mask_token_id=mask_token_id,
                            target_layer_ids=target_layer_ids, block_size=block_size, dtype=dtype)
    overrides = json.loads(json.dumps(dict(overrides)))
    dflash_overrides = overrides.pop("dflash_config", None)
    config.update(overrides)
    set_drafter_kind(config, kind, dflash2=DFLASH2_DEFAULTS, markov_rank=DSPARK_MARKOV_RANK,
                     where="make_random_drafter_checkpoint")
    if dflash_overrides:
        config["dflash_config"].update(dflash_overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        config["layer_types"] = ["full_attention"] * int(config["num_hidden_layers"])
        config["max_window_layers"] = int(config["num_hidden_layers"])

    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    write_weights(dst, _drafter_weights(config, prefix), seed=seed, dtype=dtype)
    return dst


def _drafter_weights(cfg: Mapping[str, Any], prefix: str) -> WeightSpecs:
    """Random inits of the drafter's tensors at the targets' scale; a Qwen3
    drafter's RMSNorm is plain `x * w`, so norm weights are 1 + N(0, 0.1)."""
    n_layer = int(cfg["num_hidden_layers"])
    shapes = drafter_tensor_shapes(hidden=int(cfg["hidden_size"]), n_taps=len(cfg["dflash_config"]["target_layer_ids"]),
                                   n_layer=n_layer, n_head=int(cfg["num_attention_heads"]),
                                   n_kv=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
                                   n_ff=int(cfg["intermediate_size"]))
    depth_scale = math.sqrt(min(1.0, 4.0 / n_layer))
    out: WeightSpecs = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            init: tuple = ("one_plus", 0.1)
        else:  # the residual branches' output projections shrink with depth, as in the targets
            residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
            init = _linear_init(shape[0], shape[1], depth_scale if residual_out else 1.0)[1]
        out[prefix + name] = (shape, init, prefix + name)
    dc = cfg["dflash_config"]
    if "selector_rank" in dc:
        rank = int(dc["selector_rank"])
        for name, shape in dflash2_tensor_shapes(
                hidden=int(cfg["hidden_size"]), n_layer=n_layer, n_vocab=int(cfg["vocab_size"]),
                conv_kernel_size=int(dc["conv_kernel_size"]), conv_group_size=int(dc["conv_group_size"]),
                selector_rank=rank).items():
            if name.endswith("base_kernel"):  # static taps near 1: each position adds its predecessors
                init = ("one_plus", 0.2)
            elif name.endswith("_codebook"):  # pairwise scores of the logits' scale: std rank^-1/4 each side
                init = ("normal", rank ** -0.25)
            else:
                init = _linear_init(shape[0], shape[1])[1]
            out[prefix + name] = (shape, init, prefix + name)
    if "markov_rank" in cfg:
        for name, shape in dspark_tensor_shapes(hidden=int(cfg["hidden_size"]), n_vocab=int(cfg["vocab_size"]),
                                                markov_rank=int(cfg["markov_rank"]),
                                                confidence=bool(cfg.get("confidence_head", True))).items():
            if name == "markov_head.markov_w1.weight":  # biases of std 3, above the logits' top-1 margins
                init = ("normal", int(cfg["markov_rank"]) ** -0.25)
            elif name == "markov_head.markov_w2.weight":
                init = ("normal", 3.0 * int(cfg["markov_rank"]) ** -0.25)
            elif name == "confidence_head.proj.bias":
                init = ("normal", 0.5)
            else:
                init = _linear_init(shape[0], shape[1])[1]
            out[prefix + name] = (shape, init, prefix + name)
    return out


DSPARK_MARKOV_RANK = 16

# dflash_config of a random DFlash 2 drafter (make_random_drafter_checkpoint(kind="dflash2"))
DFLASH2_DEFAULTS: Mapping[str, int] = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16,
                                       "selector_top_k": 4}


def _target_text_config(target: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(target, Mapping):
        cfg = dict(target)
        return dict(cfg.get("text_config", cfg)), None
    tdir = Path(target)
    path = tdir / "config.json"
    if not path.is_file():
        raise ValueError(f"[make_random_drafter_gguf] target {str(tdir)!r} has no config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return dict(cfg.get("text_config", cfg)), tdir


def drafter_overrides_for_target(target: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """`make_random_drafter_checkpoint` arguments that match a target checkpoint
    directory (or its config dict): hidden size, vocabulary, the target's
    layer count, attention shape, FFN width, norm eps, RoPE base and the
    `<|MASK|>` id from its tokenizer (a config dict must carry `mask_token_id`)."""
    cfg, tdir = _target_text_config(target)
    if tdir is not None:
        mask = mask_token_id_of(tdir)
    elif "mask_token_id" in cfg:
        mask = int(cfg["mask_token_id"])
    else:
        raise ValueError("[make_random_drafter_gguf] a target config dict needs 'mask_token_id'")
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1000000.0)))
    n_head = int(cfg["num_attention_heads"])
    return {
        "hidden_size": int(cfg["hidden_size"]),
        "n_target_layers": int(cfg["num_hidden_layers"]),
        "mask_token_id": mask,
        "vocab_size": int(cfg["vocab_size"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or n_head),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head),
        "intermediate_size": int(cfg.get("intermediate_size") or 2 * int(cfg["hidden_size"])),  # MoE: none
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }


def make_random_drafter_gguf(dst_path: str | os.PathLike[str],
                             target_ckpt_dir_or_config: str | os.PathLike[str] | Mapping[str, Any], *,
                             outtype: str = "f16", seed: int = 0, target_gguf: str | os.PathLike[str] | None = None,
                             ckpt_dir: str | os.PathLike[str] | None = None, **overrides: Any) -> Path:
    """A random drafter matching the target, converted to GGUF at `dst_path`.

    The drafter's hparams come from `drafter_overrides_for_target`, then
    `overrides` (e.g. `target_layer_ids`, `num_hidden_layers`, `block_size`).
    The tokenizer is taken from `target_gguf` when given, else from the
    target directory. `ckpt_dir` keeps the intermediate HF checkpoint there
    (for a reference implementation to read); by default it is temporary.
    """
    from .convert_dflash import convert_dflash_to_gguf

    kwargs = {**drafter_overrides_for_target(target_ckpt_dir_or_config), **overrides}
    _, tdir = _target_text_config(target_ckpt_dir_or_config)

    def build(d: Path) -> Path:
        ckpt = make_random_drafter_checkpoint(d, seed=seed, **kwargs)
        return convert_dflash_to_gguf(ckpt, dst_path, outtype=outtype, target_gguf=target_gguf,
                                      target_dir=tdir)

    if ckpt_dir is not None:
        return build(Path(ckpt_dir))
    with tempfile.TemporaryDirectory(prefix="dflash-drafter-") as tmp:
        return build(Path(tmp))
