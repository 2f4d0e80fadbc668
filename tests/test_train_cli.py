"""`dflash-native train-drafter`: end to end on a tiny random target, and its up-front checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import dflash_native as dn
from dflash_native.convert import convert_hf_to_gguf
from fixtures import make_random_checkpoint

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("tcli")
    ckpt = make_random_checkpoint(d / "target", "qwen3_5", seed=3)
    data = d / "text"
    data.mkdir()
    for i in range(3):
        (data / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40)))
    return ckpt, convert_hf_to_gguf(ckpt, d / "t.gguf", outtype="f32"), data


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_native", "train-drafter", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_train_drafter_cli_end_to_end(target, tmp_path):
    ckpt, tg, data = target
    p = cli("--target", ckpt, "--data", data, "--out", tmp_path / "d", "--gguf", tmp_path / "d.gguf",
            "--target-gguf", tg, "--outtype", "f32", "--block-size", "4", "--steps", "8", "--prompts", "4",
            "--prompt-tokens", "16", "--max-new-tokens", "12", "--threads", "1", "--context-length", "20")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    # prompts of 16 tokens + 12 new: anchors see up to 26 positions, the window cuts them to 20
    assert cfg["dflash_config"]["trained_context_length"] == 20
    from gguf import GGUFReader

    assert GGUFReader(tmp_path / "d.gguf").fields["dflash.trained_context_length"].contents() == 20
    eng = dn.Engine(tg, drafter=tmp_path / "d.gguf", n_ctx=128, kv_type="f32", n_threads=2)
    prompt = [5, 6, 7, 8]
    assert eng.generate(prompt, max_tokens=16).tokens == eng.generate(prompt, max_tokens=16, speculative=False).tokens


def test_train_drafter_cli_constrained_share(target, tmp_path):
    """--constrained-share: that share of the continuations is written under random JSON schemas
    (the recipe counts them; the cache holds them, each a JSON object's text), and the drafter
    trained on them runs constrained speculative decoding equal to constrained AR."""
    ckpt, tg, data = target
    p = cli("--target", ckpt, "--data", data, "--out", tmp_path / "d", "--gguf", tmp_path / "d.gguf",
            "--target-gguf", tg, "--outtype", "f32", "--block-size", "4", "--steps", "4", "--prompts", "4",
            "--prompt-tokens", "16", "--max-new-tokens", "12", "--threads", "1", "--constrained-share", "0.5",
            "--constraint", "schemas", "--continuations-file", tmp_path / "c.json")
    assert p.returncode == 0, p.stderr[-3000:]
    recipe = json.loads((tmp_path / "d" / "recipe.json").read_text())
    assert recipe["n_constrained"] == 2 and recipe["constraint"] == "schemas"
    saved = json.loads((tmp_path / "c.json").read_text())
    tok = dn.Engine(tg, n_ctx=64, n_threads=1)
    texts = [tok.detokenize(s[len(q):]) for q, s, e in zip(saved["prompts"], saved["sequences"], saved["plan"]) if e]
    assert len(texts) == 2 and all(t.startswith('{"') for t in texts)
    eng = dn.Engine(tg, drafter=tmp_path / "d.gguf", n_ctx=128, kv_type="f32", n_threads=2)
    c = dn.JsonSchema(saved["plan"][1]["constraint"]["schema"])
    assert eng.generate([5, 6, 7, 8], max_tokens=16, constraint=c).tokens == \
        eng.generate([5, 6, 7, 8], max_tokens=16, constraint=c, speculative=False).tokens


@pytest.mark.parametrize("case", ["no-data", "empty-data", "deep-tap", "no-config", "no-target-gguf", "engine-no-gguf",
                                  "window-over-context", "zero-window", "share-without-context", "share-over-one",
                                  "constrained-torch", "constrained-over-one", "bad-constraint", "chat-prompts",
                                  "extra-torch", "extra-negative"])
def test_train_drafter_cli_fails_before_work(target, tmp_path, case):
    ckpt, tg, data = target
    args = {"--target": ckpt, "--data": data, "--out": tmp_path / "o"}
    if case == "no-data":
        args["--data"] = tmp_path / "missing"
    elif case == "empty-data":
        (tmp_path / "empty").mkdir()
        args["--data"] = tmp_path / "empty"
    elif case == "deep-tap":
        args["--target-layer-ids"] = "0,3"
    elif case == "no-target-gguf":
        args["--target-gguf"] = tmp_path / "missing.gguf"
    elif case == "engine-no-gguf":
        args["--continuations"] = "engine"
    elif case == "window-over-context":
        args.update({"--context-length": 64, "--window": 65})
    elif case == "zero-window":
        args["--window"] = 0
    elif case == "share-without-context":
        args["--long-share"] = 0.5
    elif case == "share-over-one":
        args.update({"--context-length": 64, "--long-share": 1.5})
    elif case == "constrained-torch":
        args["--constrained-share"] = 0.5
    elif case == "constrained-over-one":
        args.update({"--target-gguf": tg, "--constrained-share": 1.5})
    elif case == "bad-constraint":
        args.update({"--target-gguf": tg, "--constrained-share": 0.5, "--constraint": tmp_path / "none.json"})
    elif case == "chat-prompts":
        args.update({"--target-gguf": tg, "--constrained-share": 0.5, "--constrained-prompts": "markdown"})
    elif case == "extra-torch":
        args["--constrained-extra"] = 4
    elif case == "extra-negative":
        args.update({"--target-gguf": tg, "--constrained-extra": -1})
    else:
        args["--target"] = tmp_path
    p = cli(*[x for kv in args.items() for x in kv])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "error:" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()  # nothing was trained or written
    msg = {"no-data": "does not exist", "empty-data": "is empty", "deep-tap": "not a tap layer", "no-config": "no config.json",
           "no-target-gguf": "missing.gguf' does not exist", "engine-no-gguf": "needs the target's GGUF",
           "window-over-context": "window 65 is longer than context_length 64", "zero-window": "window must be an int",
           "share-without-context": "long_share needs context_length", "share-over-one": "long_share must be in [0, 1]",
           "constrained-torch": "constrained_share > 0 or", "constrained-over-one": "constrained_share must be in",
           "bad-constraint": "none.json' is neither", "chat-prompts": "invalid choice: 'markdown'",
           "extra-torch": "constrained_extra > 0) need", "extra-negative": "--constrained-extra: must be an int >= 0"}
    assert msg[case] in p.stderr
