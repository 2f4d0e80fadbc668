"""Random DFlash drafter checkpoints for tests and benchmarks (NumPy only).

`make_random_drafter_checkpoint` writes a directory in the layout of z-lab's
DFlash releases (config.json with `architectures: ["DFlashDraftModel"]`,
`model_type: qwen3` and `dflash_config`; model.safetensors with `fc`,
`hidden_norm`, `norm` and Qwen3 decoder layers, no embeddings or lm_head), and
`make_random_drafter_gguf` builds one that matches a target checkpoint made
by `testing.make_random_checkpoint` and converts it with
`convert_dflash_to_gguf`.

Weights are random at the scale `testing` uses for targets: linear weights
N(0, 0.5/sqrt(fan_in)), the residual output projections shrinking with depth,
norm weights 1 + N(0, 0.1) (a Qwen3 drafter's RMSNorm is plain `x * w`).
Weights depend only on (seed, tensor name, shape).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from .testing import _write_safetensors, linear_init, qwen3_attention_params, swiglu_mlp_params

__all__ = ["MASK_TOKEN_TEXT", "default_target_layer_ids", "drafter_overrides_for_target",
           "make_random_drafter_checkpoint", "make_random_drafter_gguf", "mask_token_id_of"]

MASK_TOKEN_TEXT = "<|MASK|>"
_ST_DTYPES = ("float32", "float16", "bfloat16")


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


def drafter_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, n_head: int,
                   n_kv: int, head_dim: int, max_position_embeddings: int, rms_norm_eps: float, rope_theta: float,
                   n_target_layers: int, mask_token_id: int, target_layer_ids: Sequence[int], block_size: int,
                   dtype: str) -> dict[str, Any]:
    """config.json of a z-lab DFlash drafter (Qwen3 layers, full attention, non-causal)."""
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
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids],
                          "block_size": int(block_size)},
        "dtype": dtype,
    }


def make_random_drafter_checkpoint(dst_dir: str | os.PathLike[str], *, hidden_size: int, n_target_layers: int,
                                   mask_token_id: int, vocab_size: int, target_layer_ids: list[int] | None = None,
                                   num_hidden_layers: int = 1, block_size: int = 16, seed: int = 0,
                                   dtype: str = "float32", prefix: str = "", **overrides: Any) -> Path:
    """Write a random z-lab style DFlash drafter checkpoint to `dst_dir`.

    `overrides` replace config.json keys; a `dflash_config` override is merged
    into the generated one. `prefix="model."` writes tensor names with the
    prefix some exports use. `dtype` is the safetensors dtype. The attention
    shape defaults to 4 query heads, 2 KV heads, head_dim hidden/4.
    """
    if dtype not in _ST_DTYPES:
        raise ValueError(f"[make_random_drafter_checkpoint] unknown dtype {dtype!r}; expected one of {_ST_DTYPES}")
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
    if dflash_overrides:
        config["dflash_config"].update(dflash_overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        config["layer_types"] = ["full_attention"] * int(config["num_hidden_layers"])
        config["max_window_layers"] = int(config["num_hidden_layers"])

    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    entries = [(name, shape, init, name) for name, (shape, init) in _param_shapes(config, prefix).items()]
    for stale in list(dst.glob("model*.safetensors")) + [dst / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    _write_safetensors(dst / "model.safetensors", entries, seed=seed, dtype=dtype)
    return dst


def _param_shapes(cfg: Mapping[str, Any], prefix: str) -> dict[str, tuple[tuple[int, ...], tuple]]:
    h = int(cfg["hidden_size"])
    ff = int(cfg["intermediate_size"])
    n_head, n_kv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    n_layer = int(cfg["num_hidden_layers"])
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    norm = ("one_plus", 0.1)
    depth_scale = math.sqrt(min(1.0, 4.0 / n_layer))

    lin = linear_init
    p: dict[str, tuple[tuple[int, ...], tuple]] = {
        prefix + "fc.weight": lin(h, n_taps * h),
        prefix + "hidden_norm.weight": ((h,), norm),
    }
    for il in range(n_layer):
        pre = f"{prefix}layers.{il}."
        p[pre + "input_layernorm.weight"] = ((h,), norm)
        qwen3_attention_params(p, pre, h=h, n_head=n_head, n_kv=n_kv, hd=hd, q_out=n_head * hd, norm=norm,
                               depth_scale=depth_scale)
        swiglu_mlp_params(p, pre, h=h, ff=ff, norm=norm, depth_scale=depth_scale)
    p[prefix + "norm.weight"] = ((h,), norm)
    return p


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
        "intermediate_size": int(cfg["intermediate_size"]),
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
