"""dflash-native: exact DFlash speculative decoding for GGUF models, over ggml."""

from __future__ import annotations

__version__ = "0.1.0"

try:  # Ctrl-C here, under the dflash-native command: exit 130 without a traceback (_interrupt.py)
    from . import _interrupt
    from . import _core
    from .constraint import Grammar, JsonSchema, Regex
    from .engine import Engine, GenerationResult, GenerationStats, StreamPiece, TextPiece, TokenLogprobs
    from ._embed import get_cmake_dir, get_include, get_library_dir
    from .tape import GdnTape
except KeyboardInterrupt:
    from . import _interrupt
    _interrupt.interrupted_import()
    raise

RoundResult = _core.RoundResult  # what _core.Spec.round returns (typed fields; see csrc/spec/spec.h)


def gpu_available() -> bool:
    """True when the ggml this package runs on was built with a GPU backend."""
    return bool(_core.gpu_available())


def rpc_available() -> bool:
    """True when the ggml this package runs on has ggml's RPC backend (`Engine(device="rpc://H:P")`,
    `dflash-native rpc-server`)."""
    return bool(_core.rpc_available())


def devices() -> list[dict]:
    """ggml's devices: per device a dict of `name` ("CPU", "CUDA0", "Vulkan0", "RPC0"), `description`,
    `type` ("cpu", "gpu", "igpu", "accel"), `memory_free` and `memory_total` (bytes). An RPC server
    an Engine connected to is listed too. `Engine(device=...)` takes "cpu", "gpu" (the first GPU),
    any of these names, or "rpc://HOST:PORT"."""
    return list(_core.devices())


def isa() -> str:
    """The instruction set the package's own CPU kernels (matmul, attention, GDN, conv, sampling)
    run: "avx512f", "avx2" or "portable", the CPU's best unless capped, then with " (capped)"
    ("avx2 (capped)"). ggml's own kernels run the ISA ggml was built for."""
    return _core.isa()


def set_isa(name: str | None) -> None:
    """Cap the own kernels' instruction set at "avx512", "avx2" or "portable" (None or "": the
    CPU's best), overriding the DFLASH_NATIVE_ISA environment variable (read once, at the first
    kernel or engine). Output is the same bits at every level; only speed differs. ValueError for
    an unknown name or one this CPU lacks."""
    if name is not None and not isinstance(name, str):
        raise ValueError(f"[isa] set_isa takes a str or None, got {type(name).__name__}")
    _core.set_isa(name or "")


def accept_prefix(draft, target) -> list[int]:
    """Committed tokens of one chain-verify round.

    draft: d_1..d_{B-1}, the drafter's tokens after the last committed token; target: t_0..t_{B-1},
    the target's argmax after each of [last, d_1..d_{B-1}]. Returns the longest prefix of draft
    that the target agrees with (d_i == t_{i-1}) plus the bonus token: 1..B tokens."""
    return list(_core.accept_prefix(draft, target))


def accept_tree(parents, tokens, target_argmax) -> list[int]:
    """Committed tokens of one tree-verify round.

    Node 0 is the root (the last committed token): parents[0] == -1 and parents[i] < i; tokens[i]
    is node i's token; target_argmax[i] is the target's argmax after node i. From the root, follow
    the child whose token equals the target's argmax at the current node; returns that path's
    tokens (without the root) plus the bonus token, the target's argmax at the path's last node.
    A chain (parents[i] == i - 1) gives accept_prefix(tokens[1:], target_argmax). Bad parents or
    lengths raise ValueError."""
    return list(_core.accept_tree(parents, tokens, target_argmax))


def convert_hf_to_gguf(src_dir, dst_path, *, outtype: str = "f16"):
    """Convert a Hugging Face checkpoint (config.json + safetensors) to GGUF. See dflash_native.convert."""
    from .convert import convert_hf_to_gguf as _convert

    return _convert(src_dir, dst_path, outtype=outtype)


def convert_dflash_to_gguf(src_dir, dst_path, *, outtype: str = "f16", target_gguf=None):
    """Convert a z-lab DFlash drafter checkpoint to GGUF (arch `dflash`, llama.cpp layout).
    With target_gguf, the drafter is checked against the target and carries its tokenizer."""
    from .convert_dflash import convert_dflash_to_gguf as _convert

    return _convert(src_dir, dst_path, outtype=outtype, target_gguf=target_gguf)


def quantize(src, dst, type: str = "q4_k_m", *, n_threads=None, progress: bool = True):
    """Quantize a GGUF target or DFlash drafter with llama.cpp's quantizer (type: "q4_k_m", "q8_0",
    "q6_k", "iq4_xs", ...; see dflash_native.quantization.quantize_types). Returns dst."""
    from .quantization import quantize as _quantize

    return _quantize(src, dst, type, n_threads=n_threads, progress=progress)


__all__ = [
    "Engine",
    "GdnTape",
    "GenerationResult",
    "GenerationStats",
    "Grammar",
    "JsonSchema",
    "Regex",
    "RoundResult",
    "StreamPiece",
    "TextPiece",
    "TokenLogprobs",
    "accept_prefix",
    "accept_tree",
    "convert_dflash_to_gguf",
    "convert_hf_to_gguf",
    "get_cmake_dir",
    "get_include",
    "get_library_dir",
    "gpu_available",
    "rpc_available",
    "devices",
    "isa",
    "quantize",
    "set_isa",
    "__version__",
]
