#include "gguf/quantize.h"

#include "base/common.h"

#include "llama.h"

#include <mutex>

namespace dfn {

namespace {

std::mutex g_quantize_mutex;
const std::function<void(int, const char *)> * g_on_log = nullptr;  // under g_quantize_mutex

void quantize_log(ggml_log_level level, const char * text, void * user) {
    core_log_callback(level, text, user);
    if (g_on_log && text) (*g_on_log)((int) level, text);
}

}  // namespace

uint32_t quantize_gguf(const std::string & src, const std::string & dst, int ftype, int n_threads,
                       const std::function<void(int, const char *)> & on_log) {
    std::lock_guard<std::mutex> lock(g_quantize_mutex);
    llama_model_quantize_params p = llama_model_quantize_default_params();
    p.ftype = (llama_ftype) ftype;
    p.nthread = n_threads;
    g_on_log = &on_log;
    llama_log_set(quantize_log, nullptr);
    uint32_t rc = 1;
    try {
        rc = llama_model_quantize(src.c_str(), dst.c_str(), &p);  // catches its own exceptions: rc != 0
    } catch (...) {
        g_on_log = nullptr;
        llama_log_set(core_log_callback, nullptr);
        throw;
    }
    g_on_log = nullptr;
    llama_log_set(core_log_callback, nullptr);
    return rc;
}

}  // namespace dfn
