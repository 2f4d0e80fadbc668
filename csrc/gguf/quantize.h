// llama.cpp's quantizer (libllama's llama_model_quantize) over a GGUF target or DFlash drafter,
// with its log lines handed to a callback while it runs (progress and errors; quantization.py).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dfn {

// Writes `src` to `dst` as llama.cpp's file type `ftype` (LLAMA_FTYPE_*) on n_threads threads
// (<= 0: every core). on_log(level, line) gets every line llama.cpp logs meanwhile (the core's
// logger gets them too). Returns llama.cpp's status: 0 on success. One quantization at a time
// per process (llama.cpp's logger is global).
uint32_t quantize_gguf(const std::string & src, const std::string & dst, int ftype, int n_threads,
                       const std::function<void(int, const char *)> & on_log);

}  // namespace dfn
