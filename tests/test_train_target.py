"""Smoke tests of dflash_native.train: corpus validation, tokenizer training, a few
target training steps, and the trained checkpoint through our converter and Engine.

Sizes are tiny (a few stdlib files, a 2-layer hidden-64 hybrid) so the module runs in
well under a minute on two cores; throughput is measured outside the tests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dflash_native as dn  # noqa: E402
from dflash_native.convert import convert_hf_to_gguf  # noqa: E402
from dflash_native.train import corpus  # noqa: E402
from dflash_native.train.target import train_target  # noqa: E402
from dflash_native.train.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer  # noqa: E402

FILES = ["json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py",
         "textwrap.py", "shlex.py", "string.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, full_attention_interval=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
TOL_HF_F32 = 2e-3  # as tests/test_engine.py: HF and ggml sum in different orders
TEXT = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello, {name}!"  # 42\n'


@pytest.fixture(scope="module")
def files():
    root = corpus.stdlib_root()
    return [root / f for f in FILES]


@pytest.fixture(scope="module")
def tok_dir(files, tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512, root=files)


@pytest.fixture(scope="module")
def trained(tok_dir, files, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    train_target(out, tokenizer_dir=tok_dir, root=files, steps=30, seq_len=64, batch_size=4, lr=3e-3, seed=0,
                 n_threads=1, eval_every=1000, n_eval_batches=2, log_every=5, **TINY)
    return out


def test_corpus_split_is_stable_and_disjoint(files):
    split = corpus.split_files(files)
    train, held = [n for n, _ in split["train"]], [n for n, _ in split["heldout"]]
    assert held and train and not set(train) & set(held)
    assert sorted(train + held) == sorted(str(f) for f in files)
    assert corpus.split_files(list(reversed(files))) == split
    assert list(corpus.iter_files("heldout", root=files)) == [p for _, p in split["heldout"]]
    assert len(corpus.load_text("train", max_bytes=1, root=files)) > 0  # at least one whole file


def test_default_corpus_excludes_tests():
    names = [n for n, _ in corpus.corpus_files()]
    assert "os.py" in names
    assert not [n for n in names if set(n.split("/")[:-1]) & corpus.EXCLUDED_DIRS]


def test_bad_corpus_raises_before_work(tmp_path, tok_dir):
    with pytest.raises(ValueError, match="does not exist"):
        corpus.corpus_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="does not exist"):
        train_tokenizer(tmp_path / "t", root=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("")
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(tmp_path / "t", root=tmp_path / "empty")
    with pytest.raises(ValueError, match="empty"):
        train_target(tmp_path / "m", tokenizer_dir=tok_dir, root=tmp_path / "empty", steps=1)
    with pytest.raises(ValueError, match="does not exist"):
        train_target(tmp_path / "m", tokenizer_dir=tok_dir, root=[tmp_path / "nope.py"], steps=1)
    assert not (tmp_path / "t").exists() and not (tmp_path / "m").exists()


def test_tokenizer_is_deterministic_and_round_trips(tok_dir, files, tmp_path):
    again = train_tokenizer(tmp_path, vocab_size=512, root=list(reversed(files)), seed=0)
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    tok = load_tokenizer(tok_dir)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(512 - len(SPECIAL_TOKENS), 512))
    for text in (TEXT, "Café naïve — 日本語 🙂\n\t\tx", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|MASK|><|endoftext|>").ids == [511, 508]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "<|im_start|>" in config["chat_template"]


def test_heldout_prompts_come_from_heldout_files(tok_dir, files):
    tok = load_tokenizer(tok_dir)
    held = {n for n, _ in corpus.split_files(files)["heldout"]}
    prompts = corpus.heldout_prompts(3, 48, tok, root=files)
    assert prompts == corpus.heldout_prompts(3, 48, tok, root=files)
    for p in prompts:
        assert p.source in held and 24 <= p.n_tokens <= 48
        assert p.n_tokens == len(tok.encode(p.text).ids) and p.text.endswith("\n")
        assert p.text.lstrip().startswith(("def ", "class ", "async def "))
    with pytest.raises(ValueError, match="held-out prompts"):
        corpus.heldout_prompts(10_000, 48, tok, root=files)


def test_training_lowers_loss_and_records_recipe(trained):
    recipe = json.loads((trained / "recipe.json").read_text())
    curve = [c["loss"] for c in recipe["results"]["loss_curve"]]
    assert curve[-1] < curve[0] - 0.5, curve
    assert recipe["train"]["seed"] == 0 and recipe["train"]["n_tokens_seen"] == 30 * 4 * 64
    assert recipe["model"]["config"]["vocab_size"] == 512
    assert np.isfinite(recipe["results"]["final_heldout_loss"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (trained / name).is_file()


def test_trained_checkpoint_runs_in_engine(trained, tmp_path):
    gguf = convert_hf_to_gguf(trained, tmp_path / "t.gguf", outtype="f32")
    eng = dn.Engine(gguf, n_ctx=128, kv_type="f32", n_threads=2)
    tok = load_tokenizer(trained)
    ids = tok.encode(TEXT).ids
    assert eng.tokenize(TEXT) == ids  # llama.cpp's qwen35 pre-tokenizer = HF's regex
    assert eng.detokenize(ids) == TEXT
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().numpy()
    ours = eng.eval(ids)
    assert ours.shape == ref.shape
    diff = float(np.abs(ours - ref).max())
    print(f"trained tiny target: max |ours - HF| = {diff:.2e}")
    assert diff < TOL_HF_F32
