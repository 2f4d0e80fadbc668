"""The hybrid models' Gated DeltaNet side (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): layer types, the
M-RoPE sections, the GDN dims and keys, and the value-head reorder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import gguf

from ..hparams import ModelSpec
from ...hf_formats import default_mrope_section, hybrid_layer_types


# ---------------------------------------------------------------------------
# Qwen3.5 (hybrid Gated DeltaNet + gated full attention)
# ---------------------------------------------------------------------------

def qwen35_layer_types(spec: ModelSpec) -> list[str]:
    n_layer = int(spec.require("num_hidden_layers"))
    layer_types = spec.get("layer_types")
    if layer_types is None:
        return hybrid_layer_types(n_layer, int(spec.require("full_attention_interval")))
    if len(layer_types) != n_layer:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: layer_types has {len(layer_types)} "
                         f"entries, num_hidden_layers is {n_layer}")
    bad = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"[convert] {spec.src_dir / 'config.json'}: unsupported layer_types {bad}")
    return list(layer_types)


def _full_attention_interval(layer_types: Sequence[str]) -> int | None:
    """The interval k with layer i full iff (i+1) % k == 0, if the pattern has one."""
    for k in range(1, len(layer_types) + 2):
        if hybrid_layer_types(len(layer_types), k) == list(layer_types):
            return k
    return None


def text_mrope_sections(n_rot: int, head_dim: int, given: Sequence[int] | None) -> list[int]:
    """`rope.dimension_sections` for a text model.

    For text every section gets the same position, so the sections only have
    to keep ggml's interleaved M-RoPE from ever picking the 4th ("e") position,
    which llama.cpp sets to 0 for text, and satisfy sum(sections) <= head_dim
    (a GGML_ASSERT). HF's value (default [11, 11, 10]) is kept when it does so;
    otherwise the equal split of the n_rot/2 rotated pairs is used.
    """
    n_pairs = n_rot // 2

    def text_safe(s: Sequence[int]) -> bool:
        total = sum(s)
        if total <= 0 or total > head_dim:
            return False
        for k in range(n_pairs):
            sector = k % total
            if not (sector < 3 * s[sector % 3]):
                return False
        return True

    if given is not None:
        sections = [int(x) for x in given][:4]
        sections += [0] * (4 - len(sections))
        if text_safe(sections[:3]) and sections[3] == 0:
            return sections
    derived = default_mrope_section(n_rot) + [0]
    if not text_safe(derived[:3]):
        derived = [max(1, derived[0]), derived[1], derived[2], 0]
    return derived


@dataclass(frozen=True)
class GdnDims:
    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.n_v_heads // self.n_k_heads


def gdn_dims(spec: ModelSpec) -> GdnDims:
    d = GdnDims(int(spec.get("linear_num_key_heads")), int(spec.get("linear_num_value_heads")),
                 int(spec.get("linear_key_head_dim")), int(spec.get("linear_value_head_dim")),
                 int(spec.get("linear_conv_kernel_dim")))
    where = spec.src_dir / "config.json"
    if d.n_k_heads <= 0 or d.n_v_heads % d.n_k_heads != 0:
        raise ValueError(f"[convert] {where}: linear_num_value_heads ({d.n_v_heads}) must be a multiple "
                         f"of linear_num_key_heads ({d.n_k_heads})")
    if d.head_k_dim != d.head_v_dim:
        raise ValueError(f"[convert] {where}: linear_key_head_dim ({d.head_k_dim}) != linear_value_head_dim "
                         f"({d.head_v_dim}); llama.cpp's qwen35 (ggml_gated_delta_net) needs them equal")
    return d


def v_heads_grouped_to_tiled(x: np.ndarray, axis: int, n_k_heads: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """Reorder value heads along `axis` from HF's grouped order
    [k0: v0..v(r-1), k1: v0..v(r-1), ...] to ggml's tiled order
    [v0 of k0, v0 of k1, ..., v1 of k0, ...] (head j*n_k + i holds HF head i*r + j)."""
    axis = axis % x.ndim
    shape = x.shape
    if shape[axis] != n_k_heads * v_per_k * head_dim:
        raise ValueError(f"[convert] V-head reorder: axis {axis} has {shape[axis]} entries, expected "
                         f"{n_k_heads} x {v_per_k} x {head_dim}")
    y = x.reshape(shape[:axis] + (n_k_heads, v_per_k, head_dim) + shape[axis + 1:])
    y = np.swapaxes(y, axis, axis + 1)
    return np.ascontiguousarray(y).reshape(shape)


def neg_exp(x: np.ndarray) -> np.ndarray:
    """ssm_a = -exp(A_log) in float64, then rounded once: the F32 result is the same on every machine
    (NumPy's F32 exp differs by SIMD path) and is torch's (HF's, llama.cpp's converter's) within 1 ulp."""
    return (-np.exp(x.astype(np.float64))).astype(np.float32)


def gdn_kv(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """The hybrids' (Qwen3.5, Qwen3-Next) GDN keys and layer pattern."""
    d = gdn_dims(spec)
    writer.add_ssm_conv_kernel(d.conv_kernel)
    writer.add_ssm_state_size(d.head_k_dim)
    writer.add_ssm_group_count(d.n_k_heads)
    writer.add_ssm_time_step_rank(d.n_v_heads)
    writer.add_ssm_inner_size(d.value_dim)
    layer_types = qwen35_layer_types(spec)
    # The per-layer array is what llama.cpp reads first; the interval is its fallback.
    writer.add_array(f"{spec.gguf_arch}.attention.recurrent_layers",
                     [t == "linear_attention" for t in layer_types])
    interval = _full_attention_interval(layer_types)
    if interval is not None:
        writer.add_full_attention_interval(interval)
