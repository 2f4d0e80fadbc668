// A bounds-checked walk over a GGUF file's header, metadata and tensor infos, before ggml parses it.
#pragma once

#include <cstdint>
#include <string>

namespace dfn {

// Throws input_error naming the file, the key or tensor, and the field when any length, count,
// type or offset in the file is impossible: a count larger than the bytes left could hold, a
// string past the end of the file, an unknown value or tensor type, more than 4 dims, an element
// count that overflows, tensor data out of order, misaligned or past the end of the file. ggml's
// reader rejects these too, but says only "failed to read key-value pairs" (through its log), and
// a count it believes makes it allocate before it reads.
void check_gguf_layout(const std::string & path, uint64_t file_size);

}  // namespace dfn
