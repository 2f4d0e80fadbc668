#include "common.h"

#include "ggml.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace dfn {

static std::mutex g_log_mutex;
static std::string g_last_error;
static bool g_verbose = false;

static void log_callback(ggml_log_level level, const char * text, void * /*user*/) {
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
    ggml_log_set(log_callback, nullptr);
}

}  // namespace dfn
