#include "gguf/tokenizer.h"

#include "base/alloc.h"
#include "base/common.h"
#include "gguf/gguf_file.h"
#include "gguf/vocab.h"

#include "llama.h"

#include <algorithm>
#include <climits>
#include <mutex>

namespace dfn {

static const char * W = "tokenizer";
// What llama.cpp's vocab-only load may still need beside what it failed on (it builds a context):
// a NULL load with less address space than this left is memory running out.
static constexpr size_t k_load_headroom = (size_t) 128 << 20;

// llama.cpp's logger into the core's (common.h: quiet unless DFLASH_NATIVE_VERBOSE, the last
// error kept for messages); llama_log_set sets ggml's logger too, so this also re-installs that.
static void init_llama() {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
    install_ggml_log();
    llama_log_set(core_log_callback, nullptr);
}

std::unique_ptr<tokenizer> tokenizer::load(const std::string & path) {
    std::unique_ptr<tokenizer> t(new tokenizer());
    {
        gguf_file f(path);  // parsed once for both answers
        if (!check_vocab(f)) return nullptr;
        const char * key = "tokenizer.chat_template";
        if (f.has_key(key)) {
            t->chat_template_ = f.get_str(key);
            t->has_chat_template_ = true;
        }
    }
    init_llama();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    t->model_ = llama_model_load_from_file(path.c_str(), mp);  // catches its own exceptions: NULL
    if (!t->model_) {
        const std::string why = last_ggml_error();
        // check_vocab has validated the file: a NULL with little memory left is memory
        if (why.find("bad_alloc") != std::string::npos)
            throw memory_error(cat("[", W, "] out of memory loading the vocabulary of '", path, "'"));
        require_headroom(k_load_headroom, W, cat("loading the vocabulary of '", path, "'"));
        throw input_error(cat("[", W, "] llama.cpp could not load the vocabulary of '", path, "'",
                              why.empty() ? "" : ": ", why));
    }
    t->vocab_ = llama_model_get_vocab(t->model_);
    t->n_vocab_ = llama_vocab_n_tokens(t->vocab_);
    t->bos_ = llama_vocab_bos(t->vocab_);
    t->eos_ = llama_vocab_eos(t->vocab_);
    t->pieces_.resize((size_t) std::max(t->n_vocab_, 0));
    return t;
}

tokenizer::~tokenizer() {
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> tokenizer::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    DFN_REQUIRE(text.size() < (size_t) INT32_MAX / 2, W, "text of ", text.size(), " bytes is too long to tokenize");
    std::vector<int32_t> out(text.size() + 8);
    while (true) {
        const int32_t got = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                                           add_special, parse_special);
        if (got >= 0) {
            out.resize((size_t) got);
            return out;
        }
        // too small: llama.cpp says how many it needs (INT32_MIN: more than an int32 counts)
        DFN_REQUIRE(got != INT32_MIN, W, "text of ", text.size(), " bytes has too many tokens");
        out.resize((size_t) -(int64_t) got);
    }
}

const std::string & tokenizer::piece(int32_t token) const {
    DFN_REQUIRE(token >= 0 && token < n_vocab_, W, "token id ", token, " is outside the vocabulary [0, ", n_vocab_, ")");
    std::lock_guard<std::mutex> lock(pieces_mutex_);
    std::unique_ptr<std::string> & p = pieces_[(size_t) token];
    if (!p) {
        std::string buf(64, '\0');
        while (true) {
            const int32_t got = llama_token_to_piece(vocab_, token, buf.data(), (int32_t) buf.size(), 0, true);
            if (got >= 0) {
                buf.resize((size_t) got);
                break;
            }
            buf.resize((size_t) -(int64_t) got);
        }
        p = std::make_unique<std::string>(std::move(buf));
    }
    return *p;
}

std::string tokenizer::detokenize(const int32_t * tokens, int64_t n) const {
    // The pieces concatenated, as the Python tokenizer always joined them; llama_detokenize would
    // also clean up spaces for some vocabularies (tokenizer_clean_spaces), which generate() never did.
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += piece(tokens[i]);
    return out;
}

bool tokenizer::is_eog(int32_t token) const {
    return token >= 0 && token < n_vocab_ && llama_vocab_is_eog(vocab_, token);
}

bool tokenizer::is_control(int32_t token) const {
    return token >= 0 && token < n_vocab_ && llama_vocab_is_control(vocab_, token);
}

}  // namespace dfn
