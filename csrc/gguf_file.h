// GGUF reading: metadata access with validation, and tensor data into backend buffers.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dfn {

// One opened GGUF file: metadata parsed, tensors described in a no_alloc ggml context.
// Tensor data is read by load_weights() into a backend buffer that this object owns.
class gguf_file {
public:
    explicit gguf_file(const std::string & path);
    ~gguf_file();
    gguf_file(const gguf_file &) = delete;
    gguf_file & operator=(const gguf_file &) = delete;

    const std::string & path() const { return path_; }
    std::string arch() const { return get_str("general.architecture"); }

    bool has_key(const std::string & key) const;
    gguf_type kv_type(const std::string & key) const;   // GGUF_TYPE_COUNT if absent
    gguf_type arr_type(const std::string & key) const;  // element type; GGUF_TYPE_COUNT if absent or not an array
    uint32_t get_u32(const std::string & key) const;            // any integer type, range-checked
    uint32_t get_u32(const std::string & key, uint32_t def) const;
    float get_f32(const std::string & key) const;               // finite values only
    float get_f32(const std::string & key, float def) const;
    bool get_bool(const std::string & key, bool def) const;
    std::string get_str(const std::string & key) const;
    std::string get_str(const std::string & key, const std::string & def) const;
    std::vector<int64_t> get_int_arr(const std::string & key) const;  // empty if absent
    std::vector<std::string> get_str_arr(const std::string & key) const;  // throws unless a string array
    int64_t arr_len(const std::string & key) const;                    // -1 if absent or not an array

    // Tensor lookup. `required` tensors throw when missing; any tensor throws when its shape
    // differs from `ne` (an empty `ne` skips the shape check).
    ggml_tensor * tensor(const std::string & name, std::vector<int64_t> ne, bool required = true) const;
    bool has_tensor(const std::string & name) const { return tensors_.count(name) != 0; }

    // Allocate every tensor in `buft` and read its data from the file.
    void load_weights(ggml_backend_buffer_type_t buft);
    size_t weights_bytes() const;

private:
    std::string path_;
    gguf_context * gguf_ = nullptr;
    ggml_context * ctx_ = nullptr;      // tensor metadata (no_alloc)
    ggml_backend_buffer_t buf_ = nullptr;
    std::map<std::string, ggml_tensor *> tensors_;
    int64_t key_id(const std::string & key) const;  // -1 if absent
};

}  // namespace dfn
