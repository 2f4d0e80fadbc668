"""Training a small hybrid target and its DFlash drafter on a local corpus.

An optional part of the package: `tokenizer` needs `tokenizers`; `target`,
`drafter` and `pipeline` need torch and transformers (the `[train]` extra).
`corpus` is standard library only (the demo takes its held-out prompts from it),
and this file imports nothing, so `import dflash_native` works without them.

    from dflash_native.train import corpus, tokenizer, target, pipeline
    tokenizer.train_tokenizer("tok", vocab_size=4096)
    target.train_target("ckpt", tokenizer_dir="tok", steps=320)
    pipeline.run("ckpt", None, "drafter", target_gguf="ckpt.gguf", out_gguf="drafter.gguf")
"""
