"""Random Hugging Face checkpoints for tests and benchmarks (NumPy only).

`make_random_checkpoint` writes a directory that transformers loads with
`AutoModelForCausalLM.from_pretrained` (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and that `convert_hf_to_gguf` converts:
a Qwen3 (`Qwen3ForCausalLM`) or Qwen3.5 text (`Qwen3_5ForCausalLM`,
`qwen3_5_text`) model with random weights at a scale that keeps logits
informative and long decodes stable. The tokenizer is a byte-level BPE in the
Qwen layout (NFC, the Qwen regex split, ByteLevel) whose merges are learned in
pure Python from a fixed local corpus, plus the ChatML special tokens and
`<|MASK|>`.

Defaults are tiny (hidden 64, 2-4 layers). Every config key can be
overridden, and `vocab_size` may exceed the tokenizer's size (the extra ids
are unused padding), so a benchmark can build a full-size shape, e.g.
`make_random_checkpoint(d, "qwen3_5", **SHAPE_QWEN35_0_8B)`.
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

__all__ = [
    "CHATML_TEMPLATE",
    "SHAPE_QWEN35_0_8B",
    "SPECIAL_TOKENS",
    "TINY_VARIANTS",
    "make_random_checkpoint",
    "make_random_gguf",
    "make_tokenizer_files",
]

# Roughly Qwen3.5-0.8B's text model (hidden 1024, 24 layers, one full-attention
# layer in four, 248k vocabulary, tied embeddings).
SHAPE_QWEN35_0_8B: Mapping[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "full_attention_interval": 4,
    "vocab_size": 248320,
    "tie_word_embeddings": True,
}

# Small shapes the tests sweep, as `make_random_checkpoint` overrides. "odd"
# sits off the usual grid: hidden 96, head_dim 40 / 24 (n_head * head_dim !=
# hidden), 1 KV head, odd FFN width (rows that are not whole Q8_0 blocks),
# padded vocabulary, and for Qwen3.5 a full-attention first layer that no
# interval describes, conv kernel 3 and 3 key / 6 value GDN heads. Qwen3.5's
# default has 2 key / 4 value heads (the V-head reorder matters); "kv_equal"
# has as many value heads as key heads (it does not). Tied and untied
# embeddings both appear for each arch.
TINY_VARIANTS: Mapping[str, Mapping[str, Mapping[str, Any]]] = {
    "qwen3": {
        "default": {},
        "odd": {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 40,
                "intermediate_size": 200, "num_hidden_layers": 3, "vocab_size": 700, "tie_word_embeddings": False},
    },
    "qwen3_5": {
        "default": {},
        "odd": {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 24,
                "intermediate_size": 200, "num_hidden_layers": 3,
                "layer_types": ["full_attention", "linear_attention", "linear_attention"],
                "linear_num_key_heads": 3, "linear_num_value_heads": 6, "linear_key_head_dim": 24,
                "linear_value_head_dim": 24, "linear_conv_kernel_dim": 3, "vocab_size": 700,
                "tie_word_embeddings": True},
        "kv_equal": {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
                     "linear_value_head_dim": 32},
    },
}

# Added tokens, in id order after the BPE vocabulary: (text, special).
SPECIAL_TOKENS: Sequence[tuple[str, bool]] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|MASK|>", True),
    ("<think>", False),
    ("</think>", False),
)

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

_DEFAULT_MERGES = 300

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

_ARCH_ALIASES = {"qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen35": "qwen3_5", "qwen3_5_text": "qwen3_5"}


def make_random_checkpoint(dst_dir: str | os.PathLike[str], arch: str = "qwen3_5", *, seed: int = 0,
                           dtype: str = "float32", layout: str = "causal_lm", n_shards: int = 1,
                           **config_overrides: Any) -> Path:
    """Write a random HF checkpoint of `arch` ("qwen3_5" or "qwen3") to `dst_dir`.

    `config_overrides` replace config.json keys (for Qwen3.5, the text
    config's). `dtype` is the safetensors dtype ("float32", "bfloat16",
    "float16"). `layout="conditional_generation"` (Qwen3.5 only) writes the
    multimodal `Qwen3_5ForConditionalGeneration` layout: hparams under
    `text_config`, weights under `model.language_model.`, plus a stray vision
    and MTP tensor that a text converter must skip. `n_shards > 1` writes
    `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`.
    Weights depend only on (seed, tensor name, shape), so the same seed gives
    the same weights in every layout, dtype aside.
    """
    arch = _ARCH_ALIASES.get(arch, arch)
    if arch not in _BASE_CONFIG:
        raise ValueError(f"[make_random_checkpoint] unknown arch {arch!r}; expected 'qwen3_5' or 'qwen3'")
    if dtype not in _ST_DTYPE:
        raise ValueError(f"[make_random_checkpoint] unknown dtype {dtype!r}; expected one of {sorted(_ST_DTYPE)}")
    if layout not in ("causal_lm", "conditional_generation"):
        raise ValueError(f"[make_random_checkpoint] unknown layout {layout!r}")
    if layout == "conditional_generation" and arch != "qwen3_5":
        raise ValueError("[make_random_checkpoint] layout='conditional_generation' is Qwen3.5 only")
    if n_shards < 1:
        raise ValueError(f"[make_random_checkpoint] n_shards must be >= 1, got {n_shards}")

    cfg = _text_config(arch, config_overrides)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)

    n_tokenizer = make_tokenizer_files(dst, vocab_size=cfg["vocab_size"],
                                       regex=QWEN35_PRETOKENIZE_REGEX if arch == "qwen3_5" else QWEN2_PRETOKENIZE_REGEX)
    special_ids = {text: n_tokenizer - len(SPECIAL_TOKENS) + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    cfg["bos_token_id"] = special_ids["<|endoftext|>"]
    cfg["eos_token_id"] = special_ids["<|im_end|>"]
    cfg["pad_token_id"] = special_ids["<|endoftext|>"]
    cfg["dtype"] = dtype

    params = _param_shapes(arch, cfg)
    if layout == "conditional_generation":
        config = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": cfg,
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                              "intermediate_size": 64, "out_hidden_size": cfg["hidden_size"]},
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "dtype": dtype,
        }
        params = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): (shape, init, n)
                  for n, (shape, init, _) in params.items()}
        params["model.visual.merger.linear_fc1.weight"] = ((32, 32), ("normal", 0.02), "model.visual.merger")
        params["mtp.fc.weight"] = ((cfg["hidden_size"], 2 * cfg["hidden_size"]), ("normal", 0.02), "mtp.fc")
    else:
        config = cfg
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    _write_weights(dst, params, seed=seed, dtype=dtype, n_shards=n_shards)
    return dst


def make_random_gguf(dst_path: str | os.PathLike[str], arch: str = "qwen3_5", *, outtype: str = "f16",
                     seed: int = 0, **overrides: Any) -> Path:
    """`make_random_checkpoint` into a temporary directory, then `convert_hf_to_gguf`."""
    from .convert import convert_hf_to_gguf

    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        ckpt = make_random_checkpoint(tmp, arch, seed=seed, **overrides)
        return convert_hf_to_gguf(ckpt, dst_path, outtype=outtype)


# ---------------------------------------------------------------------------
# config and weights
# ---------------------------------------------------------------------------

def _text_mrope_section(n_rot: int) -> list[int]:
    """Split n_rot/2 rotated pairs into interleaved (t, h, w) sections: [11, 11, 10] for 64."""
    n_pairs = n_rot // 2
    return [(n_pairs - j + 2) // 3 for j in range(3)]


def _text_config(arch: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    cfg = json.loads(json.dumps(_BASE_CONFIG[arch]))
    cfg.update(json.loads(json.dumps(dict(overrides))))
    if arch == "qwen3_5":
        rp = cfg["rope_parameters"]
        if "mrope_section" not in rp:
            rp["mrope_section"] = _text_mrope_section(int(cfg["head_dim"] * rp.get("partial_rotary_factor", 0.25)))
        if "layer_types" not in overrides:
            k = int(cfg["full_attention_interval"])
            cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention"
                                  for i in range(cfg["num_hidden_layers"])]
        elif "full_attention_interval" not in overrides:
            cfg.pop("full_attention_interval", None)
    cfg.setdefault("initializer_range", 0.5 / math.sqrt(cfg["hidden_size"]))
    return cfg


def _param_shapes(arch: str, cfg: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple, str]]:
    """name -> (shape, init, seed name), in checkpoint order.

    Linear weights are N(0, 0.5/sqrt(fan_in)) so each projection shrinks its
    input a little and the residual stream stays O(1) at any width; embeddings
    are N(0, 1) / sqrt(hidden) * 2 so logits have a spread of a few units.
    Norm weights sit near their neutral value (1, or 0 for Qwen3.5's 1 + w form).
    """
    h = int(cfg["hidden_size"])
    n_vocab = int(cfg["vocab_size"])
    ff = int(cfg["intermediate_size"])
    n_head, n_kv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    centered = arch == "qwen3_5"  # Qwen3.5 RMSNorm computes x * (1 + w)
    norm = ("normal", 0.1) if centered else ("one_plus", 0.1)

    # Output projections of the residual branches shrink with depth (GPT-2 style)
    # so that deep shapes stay as well-conditioned as the tiny ones.
    depth_scale = math.sqrt(min(1.0, 4.0 / int(cfg["num_hidden_layers"])))

    lin = linear_init
    p: dict[str, tuple[tuple[int, ...], tuple]] = {}
    p["model.embed_tokens.weight"] = ((n_vocab, h), ("normal", 2.0 / math.sqrt(h)))
    layer_types = cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"])
    for il in range(int(cfg["num_hidden_layers"])):
        pre = f"model.layers.{il}."
        p[pre + "input_layernorm.weight"] = ((h,), norm)
        if arch == "qwen3_5" and layer_types[il] == "linear_attention":
            nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
            dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
            kernel = int(cfg["linear_conv_kernel_dim"])
            conv_dim = 2 * nk * dk + nv * dv
            a = pre + "linear_attn."
            p[a + "in_proj_qkv.weight"] = lin(conv_dim, h)
            p[a + "in_proj_z.weight"] = lin(nv * dv, h)
            p[a + "in_proj_b.weight"] = lin(nv, h)
            p[a + "in_proj_a.weight"] = lin(nv, h)
            p[a + "conv1d.weight"] = ((conv_dim, 1, kernel), ("normal", 1.0 / math.sqrt(kernel)))
            p[a + "dt_bias"] = ((nv,), ("uniform", -1.0, 1.0))
            p[a + "A_log"] = ((nv,), ("log_uniform", 0.5, 8.0))  # decay rate A in [0.5, 8]
            p[a + "norm.weight"] = ((dv,), ("one_plus", 0.1))     # gated norm: plain x * w
            p[a + "out_proj.weight"] = lin(h, nv * dv, depth_scale)
        else:
            q_out = n_head * hd * (2 if arch == "qwen3_5" else 1)  # Qwen3.5: per head [q | gate]
            qwen3_attention_params(p, pre, h=h, n_head=n_head, n_kv=n_kv, hd=hd, q_out=q_out, norm=norm,
                                   depth_scale=depth_scale)
        swiglu_mlp_params(p, pre, h=h, ff=ff, norm=norm, depth_scale=depth_scale)
    p["model.norm.weight"] = ((h,), norm)
    if not cfg["tie_word_embeddings"]:
        p["lm_head.weight"] = ((n_vocab, h), ("normal", 2.0 / math.sqrt(h)))
    return {name: (shape, init, name) for name, (shape, init) in p.items()}


def linear_init(n_out: int, n_in: int, scale: float = 1.0) -> tuple[tuple[int, int], tuple]:
    """(shape, init) of a random linear layer, std 0.5 / sqrt(n_in) (times `scale`)."""
    return (n_out, n_in), ("normal", scale * 0.5 / math.sqrt(n_in))


def qwen3_attention_params(p: dict, pre: str, *, h: int, n_head: int, n_kv: int, hd: int, q_out: int, norm: tuple,
                           depth_scale: float) -> None:
    """Qwen3-style attention (q/k norms) of one layer into p: name -> (shape, init)."""
    s = pre + "self_attn."
    p[s + "q_proj.weight"] = linear_init(q_out, h)
    p[s + "k_proj.weight"] = linear_init(n_kv * hd, h)
    p[s + "v_proj.weight"] = linear_init(n_kv * hd, h)
    p[s + "o_proj.weight"] = linear_init(h, n_head * hd, depth_scale)
    p[s + "q_norm.weight"] = ((hd,), norm)
    p[s + "k_norm.weight"] = ((hd,), norm)


def swiglu_mlp_params(p: dict, pre: str, *, h: int, ff: int, norm: tuple, depth_scale: float) -> None:
    """post_attention_layernorm + SwiGLU MLP of one layer into p."""
    p[pre + "post_attention_layernorm.weight"] = ((h,), norm)
    p[pre + "mlp.gate_proj.weight"] = linear_init(ff, h)
    p[pre + "mlp.up_proj.weight"] = linear_init(ff, h)
    p[pre + "mlp.down_proj.weight"] = linear_init(h, ff, depth_scale)


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


# ---------------------------------------------------------------------------
# safetensors writing
# ---------------------------------------------------------------------------

_ST_DTYPE = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def _to_bytes(x: np.ndarray, dtype: str) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.astype("<f4").tobytes()
    if dtype == "float16":
        return x.astype("<f2").tobytes()
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)  # nearest even
    return rounded.astype("<u2").tobytes()


def _write_safetensors(path: Path, entries: Sequence[tuple[str, tuple[int, ...], tuple, str]], *,
                       seed: int, dtype: str) -> int:
    """Stream tensors into one .safetensors file; returns the data size in bytes."""
    st_dtype, itemsize = _ST_DTYPE[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _, _ in entries:
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, shape, init, seed_name in entries:
            f.write(_to_bytes(_init_tensor(seed, seed_name, shape, init), dtype))
    return offset


def _write_weights(dst: Path, params: Mapping[str, tuple[tuple[int, ...], tuple, str]], *,
                   seed: int, dtype: str, n_shards: int) -> None:
    entries = [(name, shape, init, seed_name) for name, (shape, init, seed_name) in params.items()]
    for stale in list(dst.glob("model*.safetensors")) + [dst / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if n_shards == 1:
        _write_safetensors(dst / "model.safetensors", entries, seed=seed, dtype=dtype)
        return
    n_shards = min(n_shards, len(entries))
    shards = [entries[i::n_shards] for i in range(n_shards)]
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        total += _write_safetensors(dst / fname, shard, seed=seed, dtype=dtype)
        weight_map.update({name: fname for name, *_ in shard})
    with open(dst / "model.safetensors.index.json", "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

# Fixed training text: a little of everything the tokenizer tests feed it
# (prose, code, digits, accented Latin, Cyrillic, Greek, CJK, emoji, whitespace).
_CORPUS_SAMPLE = """\
The quick brown fox jumps over the lazy dog. It's what they'd said: we'll see, you're right, I've been there.
Speculative decoding drafts a block of tokens and the target model verifies them in one forward pass.
def accept_prefix(draft_tokens, target_tokens):
    n_accept = 0
    for d, t in zip(draft_tokens, target_tokens):
        if d != t:
            break
        n_accept += 1
    return n_accept

for (int i = 0; i < n_tokens; ++i) { sum += logits[i] * 0.5f; }
Numbers: 0 1 2 3 42 1024 65536 3.14159 2026-11-21 12:30:45 +1 (555) 010-9999
Café, naïve, résumé, façade, über, Straße, jalapeño, smörgåsbord, crème brûlée.
Привет, мир! Как дела? Это тест токенизатора.
Γειά σου κόσμε, αυτό είναι ένα τεστ.
日本語のテキストとトークナイザーのテスト。中文分词测试，你好世界。한국어 테스트입니다.
Emoji: 🙂 🚀 👍🏽 ❤️ ✨ and symbols → ≤ ≥ ∑ √ ∞ ° © ™
Whitespace:    four spaces,\ttab,\t\ttwo tabs,
newlines


and trailing spaces   
"""


def _bytes_to_unicode() -> dict[int, str]:
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


# An approximation of the Qwen split with the stdlib `re`: it only shapes the
# training words; encoding uses the exact regex in tokenizer.json.
_TRAIN_SPLIT = re.compile(r"""'(?:[sdmt]|ll|ve|re)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _training_corpus() -> str:
    here = Path(__file__).resolve().parent
    sources = [(here / name).read_text(encoding="utf-8") for name in ("convert.py", "testing.py")
               if (here / name).is_file()]
    return "\n".join([_CORPUS_SAMPLE * 30] + sources)


@functools.lru_cache(maxsize=8)
def _learn_bpe(n_merges: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Learn `n_merges` byte-level BPE merges; returns (vocab in id order, merges)."""
    byte_map = _bytes_to_unicode()
    vocab: list[str] = list(byte_map.values())
    seen = set(vocab)
    word_counts = Counter(_TRAIN_SPLIT.findall(_training_corpus()))
    words: list[list[str]] = [[byte_map[b] for b in w.encode("utf-8")] for w in word_counts]
    freqs: list[int] = list(word_counts.values())

    pair_counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
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
        merged = best[0] + best[1]
        if merged not in seen:
            seen.add(merged)
            vocab.append(merged)
        for wi in sorted(where.pop(best, ())):
            w = words[wi]
            for pair in zip(w, w[1:]):
                pair_counts[pair] -= freqs[wi]
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
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
                pair_counts[pair] += freqs[wi]
                where[pair].add(wi)
        pair_counts.pop(best, None)
    return tuple(vocab), tuple(merges)


def make_tokenizer_files(dst_dir: str | os.PathLike[str], *, vocab_size: int | None = None,
                         n_merges: int = _DEFAULT_MERGES, regex: str = QWEN35_PRETOKENIZE_REGEX) -> int:
    """Write tokenizer.json and tokenizer_config.json; returns the tokenizer's
    size (BPE vocabulary + added tokens). With `vocab_size`, fewer merges are
    learned if needed so that the tokenizer fits."""
    if vocab_size is not None:
        room = vocab_size - 256 - len(SPECIAL_TOKENS)
        if room < 0:
            raise ValueError(f"[make_tokenizer_files] vocab_size {vocab_size} < 256 byte tokens + "
                             f"{len(SPECIAL_TOKENS)} added tokens")
        n_merges = min(n_merges, room)
    vocab, merges = _learn_bpe(n_merges)
    dst = Path(dst_dir)
    added = [{"id": len(vocab) + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": special} for i, (text, special) in enumerate(SPECIAL_TOKENS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab)}, "merges": [list(m) for m in merges]},
    }
    with open(dst / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    write_tokenizer_config(dst, added, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return len(vocab) + len(added)


def write_tokenizer_config(dst: Path, added: Sequence[Mapping[str, Any]], *, eos_token: str, pad_token: str) -> None:
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
