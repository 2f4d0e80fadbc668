// Validation of a GGUF's tokenizer metadata before llama.cpp's vocabulary loader reads it.
#pragma once

#include "gguf/gguf_file.h"

namespace dfn {

// llama.cpp's vocabulary loader (used through llama-cpp-python for tokenization) asserts, or lets
// C++ exceptions escape its C API, on vocabularies it does not expect: duplicate tokens, a
// byte-level BPE without its 256 byte tokens, BOS/EOS it must add but cannot find, pre-tokenizers
// that are not byte-level. This checks tokenizer.ggml.* against what it needs. Returns false when
// the file has no vocabulary (no tokenizer.ggml.model, or "none" / "no_vocab"); throws input_error
// naming the file and the key when the vocabulary is broken or not a byte-level BPE ("gpt2").
bool check_vocab(const gguf_file & f);

}  // namespace dfn
