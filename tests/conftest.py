"""Shared fixtures: tiny random HF checkpoints, their GGUF conversions, and
reference logits from Hugging Face transformers and from llama.cpp.

Everything is session-scoped and cached, so a checkpoint or a conversion is
built once per test run whatever the number of tests that use it.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]

# CI runs a bounded, reproducible number of examples; `HYPOTHESIS_PROFILE=dev`
# explores more.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _import_package() -> None:
    """Make `dflash_native.convert` importable from a source checkout.

    Without an installed package we fall back to python/ on sys.path. When the
    package's __init__ cannot import the compiled `_core` (not built yet), the
    pure-Python modules are still usable: we register the package directory
    without running __init__, so the converter tests run and the engine tests
    fail on their own imports, not here.
    """
    try:
        importlib.import_module("dflash_native")
        return
    except ModuleNotFoundError as e:
        if e.name != "dflash_native":
            raise
        sys.path.insert(0, str(ROOT / "python"))
    try:
        importlib.import_module("dflash_native")
    except ImportError:
        for name in [m for m in sys.modules if m == "dflash_native" or m.startswith("dflash_native.")]:
            del sys.modules[name]
        pkg = types.ModuleType("dflash_native")
        pkg.__path__ = [str(ROOT / "python" / "dflash_native")]
        sys.modules["dflash_native"] = pkg


_import_package()

from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from fixtures import TINY_VARIANTS, make_random_checkpoint  # noqa: E402
from llamacpp_tools import plain_cpu_kernels  # noqa: E402


# Every llama.cpp model the tests load uses llama.cpp's plain CPU kernels (see plain_cpu_kernels):
# the peer the parity tests hold us to is llama.cpp's graph on ggml's CPU kernels.
plain_cpu_kernels()

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
N_THREADS = max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """hf_checkpoint(arch, variant="default") -> directory of a random HF checkpoint
    with the shape `fixtures.TINY_VARIANTS[arch][variant]` (seed 0)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, variant: str = "default") -> Path:
        key = (arch, variant)
        if key not in cache:
            cache[key] = make_random_checkpoint(tmp_path_factory.mktemp(f"hf-{arch}-{variant}"), arch, seed=0,
                                                **TINY_VARIANTS[arch][variant])
        return cache[key]

    return get


@pytest.fixture(scope="session")
def gguf_model(hf_checkpoint, tmp_path_factory) -> Callable[..., Path]:
    """gguf_model(arch, variant="default", outtype="f32") -> our GGUF conversion of
    `hf_checkpoint(arch, variant)`."""
    cache: dict[tuple[str, str, str], Path] = {}
    out_dir = tmp_path_factory.mktemp("gguf")

    def get(arch: str, variant: str = "default", outtype: str = "f32") -> Path:
        key = (arch, variant, outtype)
        if key not in cache:
            cache[key] = convert_hf_to_gguf(hf_checkpoint(arch, variant), out_dir / f"{arch}-{variant}-{outtype}.gguf",
                                            outtype=outtype)
        return cache[key]

    return get


def _round_like_gguf(model, outtype: str) -> None:
    """Round the model's 2-D weights the way the GGUF of `outtype` stores them, so that
    HF and llama.cpp run on the same weights. 1-D tensors and conv1d (3-D) stay F32
    in the GGUF too. Q8_0 blocks run along a row of the GGUF tensor, i.e. along a row
    of the HF weight, after the GDN out_proj column reorder when there is one."""
    import torch
    import gguf

    if outtype == "f32":
        return
    cfg = model.config
    for name, p in model.named_parameters():
        # 2-D weights, and MoE experts (3-D [n_expert, rows, cols]); the MoE routers (experts' and
        # shared expert's) stay F32
        if not (p.ndim == 2 or (p.ndim == 3 and ".experts." in name)) \
                or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            continue
        with torch.no_grad():
            if outtype == "f16":
                p.copy_(p.to(torch.float16).float())
            elif outtype == "bf16":
                p.copy_(p.to(torch.bfloat16).float())
            elif outtype == "q8_0":
                w = p.detach().numpy().copy()
                perm = None
                if "linear_attn.out_proj" in name and cfg.linear_num_value_heads != cfg.linear_num_key_heads:
                    n_k, d = cfg.linear_num_key_heads, cfg.linear_value_head_dim
                    r = cfg.linear_num_value_heads // n_k
                    perm = np.arange(n_k * r * d).reshape(n_k, r, d).transpose(1, 0, 2).reshape(-1)
                    w = w[:, perm]
                if w.shape[-1] % 32 == 0:
                    q8 = gguf.GGMLQuantizationType.Q8_0
                    w = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8)
                else:  # llama.cpp's converter falls back to F16 for partial blocks
                    w = w.astype(np.float16).astype(np.float32)
                if perm is not None:
                    back = np.empty_like(w)
                    back[:, perm] = w
                    w = back
                p.copy_(torch.from_numpy(np.ascontiguousarray(w)))
            else:
                raise ValueError(outtype)


@pytest.fixture(scope="session")
def hf_logits() -> Callable[..., np.ndarray]:
    """hf_logits(ckpt_dir, tokens, weights_as="f32") -> float32 [n_tokens, n_vocab]
    from transformers (torch CPU, float32, eager attention, one forward pass).
    `weights_as` first rounds the weights to what a GGUF of that outtype stores."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(N_THREADS)
    transformers.logging.set_verbosity_error()
    cache: dict[tuple[str, str, tuple[int, ...]], np.ndarray] = {}

    def run(ckpt_dir: Path, tokens: Sequence[int], weights_as: str = "f32") -> np.ndarray:
        key = (str(ckpt_dir), weights_as, tuple(tokens))
        if key not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt_dir, dtype=torch.float32, attn_implementation="eager")
            model.eval()
            _round_like_gguf(model, weights_as)
            with torch.no_grad():
                logits = model(torch.tensor([list(tokens)], dtype=torch.long)).logits[0]
            cache[key] = logits.float().numpy().copy()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def llamacpp_converter(tmp_path_factory) -> Path:
    """The directory of llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py, from the
    llama-cpp-python sdist pip fetches, once per session ($DFLASH_LLAMACPP_SRC: an extracted copy);
    run it with llamacpp_tools.convert_with_llamacpp."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's convert_hf_to_gguf.py imports sentencepiece")
    from llamacpp_tools import llamacpp_source

    return llamacpp_source(tmp_path_factory.getbasetemp() / "llamacpp-src")


@pytest.fixture(scope="session")
def llama_logits() -> Callable[..., np.ndarray]:
    """llama_logits(gguf_path, tokens) -> float32 [n_tokens, n_vocab] from llama.cpp
    (llama-cpp-python, CPU, F32 KV cache, one batch)."""
    llama_cpp = pytest.importorskip("llama_cpp")

    def run(gguf_path: Path, tokens: Sequence[int]) -> np.ndarray:
        n_ctx = max(64, len(tokens))
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                              logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              n_threads=N_THREADS, n_threads_batch=N_THREADS, verbose=False)
        try:
            llm.eval(list(tokens))
            return np.array(llm.scores[: len(tokens)], dtype=np.float32, copy=True)
        finally:
            llm.close()

    return run
