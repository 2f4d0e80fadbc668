"""Training a small hybrid target (and, later, its DFlash drafter) on a local corpus.

An optional part of the package: `tokenizer` needs `tokenizers`, `target` needs
torch and transformers. Nothing outside `dflash_native.train` imports it, and
this file imports nothing, so `import dflash_native` works without them.

    from dflash_native.train import corpus, tokenizer, target
    tokenizer.train_tokenizer("tok", vocab_size=4096)
    target.train_target("ckpt", tokenizer_dir="tok", steps=2000)
"""
