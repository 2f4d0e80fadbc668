// A GGUF's vocabulary through llama.cpp's own tokenizer (libllama, vocab_only): tokenization
// equals llama.cpp's on the same file. Used by the C API and, through _core.Tokenizer, by Python.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;
struct llama_vocab;

namespace dfn {

class tokenizer {
public:
    // nullptr when the file has no vocabulary (no tokenizer.ggml.model, or "none"). The metadata
    // is checked first (vocab.h: check_vocab, input_error on a broken vocabulary), because
    // llama.cpp's loader asserts on some; a load llama.cpp refuses throws input_error with its
    // log's last error, and one that fails for memory throws memory_error.
    static std::unique_ptr<tokenizer> load(const std::string & path);
    ~tokenizer();
    tokenizer(const tokenizer &) = delete;
    tokenizer & operator=(const tokenizer &) = delete;

    // llama_tokenize of UTF-8 text (add_special: BOS/EOS as the vocabulary asks; parse_special:
    // special-token text becomes those tokens).
    std::vector<int32_t> tokenize(const std::string & text, bool add_special = true, bool parse_special = true) const;
    // The bytes of one token (llama_token_to_piece, special tokens rendered); input_error outside
    // [0, n_vocab) (llama.cpp would throw std::out_of_range through its C API).
    const std::string & piece(int32_t token) const;
    // The pieces of `tokens` concatenated (bytes; not necessarily valid UTF-8 at a cut).
    std::string detokenize(const int32_t * tokens, int64_t n) const;
    bool is_eog(int32_t token) const;  // false outside the vocabulary
    // a control token (llama.cpp's attribute: BOS, EOS, chat markers), never text; false outside
    bool is_control(int32_t token) const;

    int32_t n_vocab() const { return n_vocab_; }
    int32_t bos() const { return bos_; }  // -1: none
    int32_t eos() const { return eos_; }
    // tokenizer.chat_template, empty when absent (has_chat_template tells the two apart)
    const std::string & chat_template() const { return chat_template_; }
    bool has_chat_template() const { return has_chat_template_; }

private:
    tokenizer() = default;
    llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    int32_t n_vocab_ = 0, bos_ = -1, eos_ = -1;
    std::string chat_template_;
    bool has_chat_template_ = false;
    mutable std::mutex pieces_mutex_;  // piece() may run on several threads
    mutable std::vector<std::unique_ptr<std::string>> pieces_;  // [n_vocab], each filled on first use
};

}  // namespace dfn
