// GGUF reading: metadata access with validation, and tensor data into backend buffers.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace dfn {

// What the graph does with a weight tensor; it decides the types the tensor may be stored as.
// One rule for every CPU role (gguf_file::tensor): F32, or a float / quantized type that ggml's
// CPU backend can both dequantize (to_float) and multiply (vec_dot) -- F16, BF16, Q4_0 .. Q8_0,
// the K- and IQ-quants, TQ, MXFP4, ... Integer types (I8 .. I64), F64, the activation-only
// formats (Q8_1, Q8_K) and removed or unknown type ids are refused at load.
enum tensor_role {
    TENSOR_ROLE_MATMUL,     // weight of a matrix product (ggml_mul_mat, or matmul.h's kernel for F16/F32)
    TENSOR_ROLE_EMBEDDING,  // rows gathered by token id (ggml_get_rows)
    TENSOR_ROLE_F32,        // small operand that element-wise ops and our CPU ops (conv.cpp) read as
                            // F32: norm weights, ssm_a, ssm_dt, ssm_conv1d; converted to F32 at load
};

// One opened GGUF file: metadata parsed, tensors described in a no_alloc ggml context.
// load_weights() gives the tensors their data: on a host buffer type, by mapping the file (the
// tensors point into the mapping: no second copy of the weights in memory); else, or when asked
// not to map, by reading it into a backend buffer. This object owns the buffers and the mapping.
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
    std::vector<std::string> keys_with_prefix(const std::string & prefix) const;

    // Tensor lookup. `required` tensors throw when missing; any tensor throws when its shape
    // differs from `ne` (an empty `ne` skips the shape check) or its type does not suit `role`.
    // A TENSOR_ROLE_F32 tensor stored in another type becomes F32 here, and load_weights()
    // converts its data; so roles must be given before load_weights().
    ggml_tensor * tensor(const std::string & name, std::vector<int64_t> ne, tensor_role role, bool required = true);
    bool has_tensor(const std::string & name) const { return tensors_.count(name) != 0; }
    // Every tensor of the file, by name.
    std::vector<ggml_tensor *> tensors() const {
        std::vector<ggml_tensor *> out;
        for (const auto & kv : tensors_) out.push_back(kv.second);
        return out;
    }

    // Gives every tensor its data. use_mmap and a host `buft` whose device takes host pointers
    // (the CPU): the file is mapped read-only (pages read ahead) and each tensor stored as it is
    // used points at its bytes in the mapping; the TENSOR_ROLE_F32 tensors converted at load are
    // copies in a small buffer of `buft`. Otherwise (a device buffer, use_mmap false, or a tensor
    // offset that is not 32-byte aligned) every tensor is read into one buffer of `buft`.
    void load_weights(ggml_backend_buffer_type_t buft, bool use_mmap = true);
    // A model split over devices: each tensor read into a buffer of place(tensor) (one buffer per
    // buffer type); a single type is load_weights(buft, use_mmap).
    using placement = std::function<ggml_backend_buffer_type_t(const ggml_tensor *)>;
    void load_weights(const placement & place, bool use_mmap = true);
    size_t weights_bytes() const;  // bytes of all tensors as used (F32 after conversion)
    size_t mapped_bytes() const { return mapped_bytes_; }  // of those, bytes read in place from the mapping
    size_t copied_bytes() const { return weights_bytes() - mapped_bytes_; }  // in buffers of their own

private:
    std::string path_;
    gguf_context * gguf_ = nullptr;
    ggml_context * ctx_ = nullptr;      // tensor metadata (no_alloc)
    ggml_backend_buffer_t buf_ = nullptr;       // the weights (the mapping's, or read into it)
    ggml_backend_buffer_t copies_ = nullptr;    // mapped file: the converted tensors
    std::vector<ggml_backend_buffer_t> more_bufs_;  // a split model: the weights on the other devices
    void * map_ = nullptr;                      // the file's mapping (nullptr: not mapped)
    size_t map_size_ = 0;
    size_t mapped_bytes_ = 0;
    std::map<std::string, ggml_tensor *> tensors_;
    std::map<std::string, ggml_type> to_f32_;  // tensors load_weights() converts: name -> type in the file
    void check_type(ggml_tensor * t, tensor_role role);
    bool map_weights(ggml_backend_buffer_type_t buft);  // false: mapping does not apply here
    void read_weights(ggml_backend_buffer_type_t buft);
    void read_tensors();  // every tensor's data from the file into its (allocated) buffer
    ggml_type file_type(const ggml_tensor * t) const;  // the tensor's type in the file
    void set_converted(ggml_tensor * t, const void * file_bytes);  // a TENSOR_ROLE_F32 tensor's data
    int64_t key_id(const std::string & key) const;  // -1 if absent
};

}  // namespace dfn
