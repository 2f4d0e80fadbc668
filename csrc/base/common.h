// Shared error handling and small utilities for the dflash-native core.
#pragma once

#include "ggml.h"

#include <sstream>
#include <stdexcept>
#include <string>

namespace dfn {

// `s` with control characters and every byte that is not part of valid UTF-8 written as \xNN.
// Messages quote names and values from files: Python decodes an exception's text as UTF-8 (one
// bad byte would turn the ValueError into a UnicodeDecodeError that says nothing about the file),
// and the text ends at its first NUL.
std::string printable_text(const std::string & s);

// Bad user input (a file, a shape, an argument): maps to Python ValueError.
struct input_error : std::invalid_argument {
    explicit input_error(const std::string & what) : std::invalid_argument(printable_text(what)) {}
};

// A failure while running (allocation, backend): maps to Python RuntimeError.
struct runtime_error : std::runtime_error {
    explicit runtime_error(const std::string & what) : std::runtime_error(printable_text(what)) {}
};

template <typename... Args>
std::string cat(const Args &... args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}

// The last message ggml logged at WARN or ERROR level; loaders append it to exceptions
// because gguf/ggml report the reason of a failure only through the log.
std::string last_ggml_error();
void install_ggml_log();  // keeps ggml quiet unless DFLASH_NATIVE_VERBOSE is set
// The logger install_ggml_log sets, for llama.cpp's llama_log_set (tokenizer.cpp).
void core_log_callback(ggml_log_level level, const char * text, void * user);

}  // namespace dfn

// GCC on x86-64: where the CPU kernels pick AVX-512 / AVX2 / baseline code at run time
// (cpu_isa.h: the level in use, DFN_MULTIVERSION).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DFN_X86_GCC 1
#else
#define DFN_X86_GCC 0
#endif

// Throw input_error with "[where] message" when cond is false.
#define DFN_REQUIRE(cond, where, ...) \
    do { if (!(cond)) throw ::dfn::input_error(::dfn::cat("[", where, "] ", __VA_ARGS__)); } while (0)
