"""Bounded, seeded fuzz run in the test suite: N_PER_CLASS structure-aware mutants per probe class
of a tiny target and its drafter, each loaded and run in a child process. A class fails on any
crash (signal), hang, or exception other than a clear ValueError / RuntimeError / MemoryError; the
STRICT_PROBES classes (renamed, extra and duplicated tensors and keys) fail on a load as well.
The same seed draws the same mutants on every run; `python -m tests.fuzz --n 5000` explores more."""

from __future__ import annotations

import pytest

from .pair import build_pair
from . import gguf_layout as G
from .probes import PROBES, STRICT_PROBES, copy_token, set_kv, set_tensor_type
from .runner import FAILURES, Files, Mutant, draw_mutants, run_mutants, table

N_PER_CLASS = 24
SEED = 12
ROLES = ("target", "drafter")

# Classes whose remaining failures are fixed on other branches of issue 12 (reason names the
# item). strict: when the fix is merged the class passes, xfail turns into a failure, and this
# entry must go.
PENDING: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(*build_pair(tmp_path_factory.mktemp("fuzz")))


@pytest.fixture(scope="module")
def outcomes(files) -> dict[tuple[str, str], list[Mutant]]:
    mutants = [Mutant(f"{role}/base/0", role, "base", "the unmutated file", []) for role in ROLES]
    for role in ROLES:
        for i, probe in enumerate(PROBES):
            mutants += draw_mutants(files, role, probe, N_PER_CLASS, SEED * 1000 + i)
    run_mutants(files, mutants, batch=16, timeout=60.0, jobs=2)
    print("\n" + table(mutants))
    by_class: dict[tuple[str, str], list[Mutant]] = {}
    for m in mutants:
        by_class.setdefault((m.role, m.probe), []).append(m)
    return by_class


@pytest.mark.parametrize("role", ROLES)
def test_unmutated_files_run(outcomes, role):
    """The harness itself works: the base files load and generate in a child."""
    (base,) = outcomes[(role, "base")]
    assert base.outcome == "ran", base.error


@pytest.mark.parametrize("probe", list(PROBES))
@pytest.mark.parametrize("role", ROLES)
def test_mutants_fail_cleanly(outcomes, role, probe, request):
    if (role, probe) in PENDING:
        request.applymarker(pytest.mark.xfail(strict=True, reason=PENDING[(role, probe)]))
    ms = outcomes[(role, probe)]
    assert ms, "no mutants drawn"
    # a renamed, extra or duplicated tensor or key is an error naming it, never a load (issue 38)
    fails = FAILURES + (("ran",) if probe in STRICT_PROBES else ())
    bad = [m for m in ms if m.outcome in fails]
    assert not bad, "\n".join(f"{m.outcome.upper()} {m.id}: {m.desc}\n    {m.error.strip()[-500:]}" for m in bad)


# Mutants that killed, hung or misled the process before the loader fixes of issue 12 (items 5
# and 6), by name: each must now end in a clear error. `pending`: fixed on another branch.
KNOWN = [
    ("target", "rms_eps NaN (ggml_rms_norm asserts eps >= 0)",
     lambda lay, b: set_kv(lay, b, "qwen35.attention.layer_norm_rms_epsilon", float("nan")), None),
    ("drafter", "rms_eps -1e-6", lambda lay, b: set_kv(lay, b, "dflash.attention.layer_norm_rms_epsilon", -1e-6), None),
    ("target", "duplicate token (llama.cpp's vocab loader asserts, stderr hidden)",
     lambda lay, b: copy_token(lay, b, 53, 97), None),
    ("target", "pre-tokenizer 'whitespace' (BPE merge lookup asserts on a raw space)",
     lambda lay, b: set_kv(lay, b, "tokenizer.ggml.pre", "whitespace"), None),
    ("target", "tokenizer model 'llama' (std::out_of_range through llama.cpp's C API: terminate)",
     lambda lay, b: set_kv(lay, b, "tokenizer.ggml.model", "llama"), None),
    ("target", "bos id outside the vocabulary (llama.cpp silently used token 11 as BOS)",
     lambda lay, b: set_kv(lay, b, "tokenizer.ggml.bos_token_id", 100000), None),
    ("target", "architecture name not UTF-8 (UnicodeDecodeError instead of ValueError)",
     lambda lay, b: set_kv(lay, b, "general.architecture", b"qwen\xff"), None),
    ("drafter", "drafter path is a FIFO (gguf-py's reader blocked on it)", lambda lay, b: [["path", "fifo"]], None),
    ("drafter", "dflash.block_size = 2^31 (was read unchecked into the target's verify batch: '[cache] cannot allocate')",
     lambda lay, b: set_kv(lay, b, "dflash.block_size", 2**31), None),
    ("target", "norm weight typed I32 (binary op aborts on the type)",
     lambda lay, b: set_tensor_type(lay, "blk.0.attn_norm.weight", 26), None),
]


@pytest.mark.parametrize("case", range(len(KNOWN)), ids=[k[1].split(" (")[0] for k in KNOWN])
def test_known_crashers(files, case, request):
    role, desc, make, pending = KNOWN[case]
    if pending:
        request.applymarker(pytest.mark.xfail(strict=True, reason=pending))
    base = (files.target if role == "target" else files.drafter).read_bytes()
    m = Mutant(f"{role}/known/{case}", role, "known", desc, make(G.parse(base), base))
    run_mutants(files, [m], timeout=60.0)
    assert m.outcome == "clean", f"{m.outcome}: {m.error}"
