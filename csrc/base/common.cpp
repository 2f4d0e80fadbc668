#include "base/common.h"

#include "ggml.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace dfn {

static std::mutex g_log_mutex;
static std::string g_last_error;
static bool g_verbose = false;

void core_log_callback(ggml_log_level level, const char * text, void * /*user*/) {
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_last_error = text ? text : "";
        while (!g_last_error.empty() && (g_last_error.back() == '\n' || g_last_error.back() == ' ')) {
            g_last_error.pop_back();
        }
    }
    if (g_verbose && text) {
        fputs(text, stderr);
    }
}

std::string printable_text(const std::string & s) {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = (unsigned char) s[i];
        // length of the sequence c starts, and the smallest code point it may encode (no overlongs)
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = n > 0 && i + n <= s.size();
        uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
        for (size_t k = 1; ok && k < n; ++k) {
            const unsigned char d = (unsigned char) s[i + k];
            ok = (d & 0xC0) == 0x80;
            cp = (cp << 6) | (d & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        ok = ok && cp >= min_cp[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF) && (cp >= 0x20 || cp == '\n') &&
             cp != 0x7F;
        if (ok) {
            out.append(s, i, n);
            i += n;
        } else {
            static const char * hex = "0123456789abcdef";
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
            i += 1;
        }
    }
    return out;
}

std::string last_ggml_error() {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::string e = g_last_error;
    g_last_error.clear();
    return e;
}

void install_ggml_log() {
    // Set on every load: llama.cpp (through llama-cpp-python) installs its own ggml logger.
    const char * v = std::getenv("DFLASH_NATIVE_VERBOSE");
    g_verbose = v && *v && *v != '0';
    ggml_log_set(core_log_callback, nullptr);
}

}  // namespace dfn
