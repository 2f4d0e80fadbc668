#include "gguf/vocab.h"

#include "base/common.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace dfn {

static const char * W = "tokenizer";

// Byte-level BPE pre-tokenizers of the llama.cpp we run on (llama-vocab.cpp). Left out: names it
// maps to SPM-style, non-byte-level splitting ("whitespace", "gemma4", "granite-embed-multi-311m",
// "sarvam-moe"): with a "gpt2" vocabulary their words keep raw spaces, which its BPE merge lookup
// asserts never happens.
static const char * const k_byte_level_pre[] = {
    "kimi-k2", "default", "minicpm5", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
    "midm-2.0", "lfm2", "jina-v5-nano", "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu",
    "falcon", "mpt", "starcoder", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
    "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "jais-2", "jina-v1-en",
    "jina-v2-code", "roberta-bpe", "refact", "command-r", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2",
    "qwen35", "stablelm2", "olmo", "dbrx", "smaug-bpe", "poro-chat", "chatglm-bpe", "glm4", "glm5", "viking",
    "jais", "tekken", "smollm", "codeshell", "bloom", "gpt3-finnish", "exaone", "exaone4", "exaone-moe",
    "chameleon", "minerva-7b", "megrez", "gpt-4o", "llama4", "kanana2", "talkie", "granite-embed-multi-97m",
    "tiny_aya", "cohere2moe", "superbpe", "trillion", "granite-docling", "bailingmoe", "bailingmoe2",
    "llada-moe", "seed-coder", "hunyuan", "hunyuan-dense", "hy_v4", "joyai-llm", "ufakzeka", "grok-2",
    "afmoe", "laguna", "minimax-m2", "solar-open", "mellum2",
};

// Special-token keys llama.cpp reads; each must name a token when present.
static const char * const k_special_ids[] = {
    "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "cls", "mask", "fim_pre", "fim_suf", "fim_mid",
    "fim_pad", "fim_rep", "fim_sep", "prefix", "suffix", "middle",
};

// GPT-2's byte -> printable code point map (bytes_to_unicode): printable Latin-1 bytes stand for
// themselves, the other 68 take 256, 257, ... in byte order.
static bool byte_is_printable(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255); }

static std::string byte_level_char(int b) {
    int cp = b;
    if (!byte_is_printable(b)) {
        int n = 0;
        for (int i = 0; i < b; ++i) n += !byte_is_printable(i);
        cp = 256 + n;
    }
    std::string s;
    if (cp < 0x80) {
        s += (char) cp;
    } else {
        s += (char) (0xC0 | (cp >> 6));
        s += (char) (0x80 | (cp & 0x3F));
    }
    return s;
}

namespace {

struct vocab_checker {
    const gguf_file & f;
    std::vector<std::string> tokens;
    std::unordered_map<std::string, int64_t> ids;

    [[noreturn]] void fail(const std::string & key, const std::string & what) const {
        throw input_error(cat("[", W, "] '", f.path(), "': ", key, ": ", what));
    }

    // An optional array of n_tokens numbers: llama.cpp reads it as the types it names, unchecked.
    void check_token_array(const char * key, std::initializer_list<gguf_type> types) {
        if (!f.has_key(key)) return;
        const gguf_type t = f.arr_type(key);
        bool ok = false;
        for (gguf_type want : types) ok = ok || t == want;
        if (!ok) fail(key, "must be an array of the right number type");
        if (f.arr_len(key) < (int64_t) tokens.size())
            fail(key, cat("has ", f.arr_len(key), " entries for ", tokens.size(), " tokens"));
    }

    void check_tokens() {
        const char * key = "tokenizer.ggml.tokens";
        if (f.arr_type(key) != GGUF_TYPE_STRING) fail(key, f.has_key(key) ? "is not a string array" : "is missing");
        tokens = f.get_str_arr(key);
        if (tokens.empty() || tokens.size() > (size_t) INT32_MAX) fail(key, cat("has ", tokens.size(), " tokens"));
        for (size_t i = 0; i < tokens.size(); ++i) {
            // llama.cpp renames empty tokens, then requires every text to be unique (an assert).
            const std::string text = tokens[i].empty() ? cat("[EMPTY_", i, "]") : tokens[i];
            const auto ins = ids.emplace(text, (int64_t) i);
            if (!ins.second) fail(key, cat("token ", i, " '", text, "' repeats token ", ins.first->second));
        }
        check_token_array("tokenizer.ggml.token_type", {GGUF_TYPE_INT32});
        check_token_array("tokenizer.ggml.scores", {GGUF_TYPE_FLOAT32, GGUF_TYPE_INT32});
        const auto types = f.get_int_arr("tokenizer.ggml.token_type");
        for (size_t i = 0; i < types.size() && i < tokens.size(); ++i) {
            // 0..6: undefined, normal, unknown, control, user-defined, unused, byte. A byte token
            // of a BPE vocabulary is read as "<0xXX>".
            const bool byte_ok = tokens[i].size() == 6 && tokens[i].compare(0, 3, "<0x") == 0 && tokens[i][5] == '>';
            if (types[i] < 0 || types[i] > 6 || (types[i] == 6 && !byte_ok))
                fail("tokenizer.ggml.token_type", cat("token ", i, " has type ", types[i]));
        }
    }

    // Byte-level BPE falls back to one token per byte for text no merge covers; a missing byte
    // token would silently drop that byte from the prompt.
    void check_byte_tokens() const {
        for (int b = 0; b < 256; ++b) {
            if (!ids.count(byte_level_char(b)))
                fail("tokenizer.ggml.tokens", cat("no token for byte 0x", std::hex, b, " ('", byte_level_char(b),
                                                  "'); a byte-level BPE vocabulary needs all 256"));
        }
    }

    void check_merges() const {
        const char * key = "tokenizer.ggml.merges";
        if (f.arr_type(key) != GGUF_TYPE_STRING) fail(key, f.has_key(key) ? "is not a string array" : "is missing");
        const auto merges = f.get_str_arr(key);
        for (size_t i = 0; i < merges.size(); ++i) {
            const std::string & m = merges[i];
            const size_t sp = m.find(' ', 1);
            const std::string a = sp == std::string::npos ? "" : m.substr(0, sp);
            const std::string b = sp == std::string::npos ? "" : m.substr(sp + 1);
            if (a.empty() || b.empty() || b.find(' ') != std::string::npos)
                fail(key, cat("merge ", i, " '", m, "' is not two tokens separated by one space"));
            for (const std::string * part : {&a, &b}) {
                if (!ids.count(*part)) fail(key, cat("merge ", i, " '", m, "': '", *part, "' is not a token"));
            }
            if (!ids.count(a + b)) fail(key, cat("merge ", i, " '", m, "' makes '", a + b, "', which is not a token"));
        }
    }

    // A special id llama.cpp would use: the file's, else its default for byte-level BPE.
    int64_t special_id(const std::string & name, int64_t def) const {
        const std::string key = "tokenizer.ggml." + name + "_token_id";
        if (!f.has_key(key)) return def < (int64_t) tokens.size() ? def : -1;
        return (int64_t) f.get_u32(key);
    }

    void check_specials() const {
        for (const char * name : k_special_ids) {
            const std::string key = cat("tokenizer.ggml.", name, "_token_id");
            if (!f.has_key(key)) continue;
            int64_t v = -1;
            try {
                v = f.get_u32(key);
            } catch (const input_error &) {
                v = -1;
            }
            if (v < 0 || v >= (int64_t) tokens.size())
                fail(key, cat("must be a token id in [0, ", tokens.size(), ")"));
        }
        for (const char * key : {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                                 "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_space_prefix",
                                 "tokenizer.ggml.remove_extra_whitespaces"}) {
            if (f.has_key(key) && f.kv_type(key) != GGUF_TYPE_BOOL) fail(key, "is not a bool");
        }
        // Tokenizing with add_special asserts that the BOS / EOS it must add exists.
        for (const char * name : {"bos", "eos"}) {
            const std::string add = cat("tokenizer.ggml.add_", name, "_token");
            if (special_id(name, 11) < 0 && (!f.has_key(add) || f.get_bool(add, true)))
                fail(cat("tokenizer.ggml.", name, "_token_id"),
                     cat("is missing, and ", add, " is not false (llama.cpp would add a token that does not exist)"));
        }
    }

    void check_pre() const {
        const char * key = "tokenizer.ggml.pre";
        if (!f.has_key(key)) return;  // llama.cpp uses "default"
        if (f.kv_type(key) != GGUF_TYPE_STRING) fail(key, "is not a string");
        const std::string pre = f.get_str(key);
        for (const char * p : k_byte_level_pre) {
            if (pre == p) return;
        }
        fail(key, cat("'", pre, "' is not a byte-level BPE pre-tokenizer of llama.cpp"));
    }
};

}  // namespace

bool check_vocab(const gguf_file & f) {
    const char * key = "tokenizer.ggml.model";
    if (!f.has_key(key)) return false;
    if (f.kv_type(key) != GGUF_TYPE_STRING) throw input_error(cat("[", W, "] '", f.path(), "': ", key, ": is not a string"));
    const std::string model = f.get_str(key);
    if (model == "none" || model == "no_vocab") return false;
    if (model != "gpt2") {
        throw input_error(cat("[", W, "] '", f.path(), "': ", key, ": '", model,
                              "' is not supported (byte-level BPE, 'gpt2', only)"));
    }
    vocab_checker c{f, {}, {}};
    c.check_pre();
    c.check_tokens();
    c.check_byte_tokens();
    c.check_merges();
    c.check_specials();
    return true;
}

}  // namespace dfn
