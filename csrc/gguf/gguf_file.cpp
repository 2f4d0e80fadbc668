#include "gguf/gguf_file.h"

#include "base/alloc.h"
#include "base/common.h"
#include "gguf/gguf_layout.h"

#include "ggml-cpu.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#define DFN_HAVE_MMAP 1
#endif

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sys/stat.h>

namespace dfn {

static const char * W = "load_gguf";

gguf_file::gguf_file(const std::string & path) : path_(path) {
    install_ggml_log();
    struct stat st;
    DFN_REQUIRE(stat(path.c_str(), &st) == 0, W, "no such file: '", path, "'");
    DFN_REQUIRE(S_ISREG(st.st_mode), W, "not a regular file: '", path, "'");

    {
        FILE * f = fopen(path.c_str(), "rb");
        DFN_REQUIRE(f != nullptr, W, "cannot open '", path, "'");
        char magic[4] = {0, 0, 0, 0};
        const size_t n = fread(magic, 1, 4, f);
        fclose(f);
        DFN_REQUIRE(n == 4 && memcmp(magic, "GGUF", 4) == 0, W, "'", path, "' is not a GGUF file (bad magic)");
    }

    check_gguf_layout(path, (uint64_t) st.st_size);

    require_headroom(size_t(4) << 20, W, "reading the GGUF metadata");  // gguf's ggml_init aborts on failure
    gguf_init_params params = {/*no_alloc =*/ true, /*ctx =*/ &ctx_};
    gguf_ = gguf_init_from_file(path.c_str(), params);
    if (!gguf_) {
        const std::string why = last_ggml_error();
        // gguf reports a failed allocation (std::bad_alloc inside it) only through its log
        if (why.find("bad_alloc") != std::string::npos) throw memory_error(cat("[", W, "] out of memory reading '", path, "': ", why));
        throw input_error(cat("[", W, "] failed to parse GGUF '", path, "'", why.empty() ? "" : ": ", why));
    }

    // gguf_init_from_file with no_alloc does not read tensor data: check that it is all there.
    const size_t data_off = gguf_get_data_offset(gguf_);
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        const char * name = gguf_get_tensor_name(gguf_, i);
        ggml_tensor * t = ggml_get_tensor(ctx_, name);
        DFN_REQUIRE(t != nullptr, W, "tensor '", name, "' missing from context");
        const size_t end = data_off + gguf_get_tensor_offset(gguf_, i) + ggml_nbytes(t);
        DFN_REQUIRE(end <= (size_t) st.st_size, W, "'", path, "' is truncated: tensor '", name, "' ends at byte ",
                    end, " but the file has ", (size_t) st.st_size, " bytes");
        tensors_[name] = t;
    }
}

gguf_file::~gguf_file() {
    if (buf_) ggml_backend_buffer_free(buf_);
    for (ggml_backend_buffer_t b : more_bufs_) ggml_backend_buffer_free(b);
    if (copies_) ggml_backend_buffer_free(copies_);
#ifdef DFN_HAVE_MMAP
    if (map_) munmap(map_, map_size_);  // after the buffers that point into it
#endif
    if (ctx_) ggml_free(ctx_);
    if (gguf_) gguf_free(gguf_);
}

int64_t gguf_file::key_id(const std::string & key) const { return gguf_find_key(gguf_, key.c_str()); }

bool gguf_file::has_key(const std::string & key) const { return key_id(key) >= 0; }

gguf_type gguf_file::kv_type(const std::string & key) const {
    const int64_t id = key_id(key);
    return id < 0 ? GGUF_TYPE_COUNT : gguf_get_kv_type(gguf_, id);
}

gguf_type gguf_file::arr_type(const std::string & key) const {
    const int64_t id = key_id(key);
    return id < 0 || gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY ? GGUF_TYPE_COUNT : gguf_get_arr_type(gguf_, id);
}

static bool read_int(const gguf_context * g, int64_t id, int64_t & out) {
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, id);  return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8(g, id);  return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, id); return true;
        default: return false;
    }
}

uint32_t gguf_file::get_u32(const std::string & key) const {
    const int64_t id = key_id(key);
    DFN_REQUIRE(id >= 0, W, "'", path_, "': missing key '", key, "'");
    int64_t v = 0;
    DFN_REQUIRE(read_int(gguf_, id, v), W, "'", path_, "': key '", key, "' is not an integer");
    DFN_REQUIRE(v >= 0 && v <= (int64_t) UINT32_MAX, W, "'", path_, "': key '", key, "' = ", v, " is out of range");
    return (uint32_t) v;
}

uint32_t gguf_file::get_u32(const std::string & key, uint32_t def) const {
    return has_key(key) ? get_u32(key) : def;
}

float gguf_file::get_f32(const std::string & key) const {
    const int64_t id = key_id(key);
    DFN_REQUIRE(id >= 0, W, "'", path_, "': missing key '", key, "'");
    const auto t = gguf_get_kv_type(gguf_, id);
    float v = 0.0f;
    int64_t iv = 0;
    if (t == GGUF_TYPE_FLOAT32) {
        v = gguf_get_val_f32(gguf_, id);
    } else if (t == GGUF_TYPE_FLOAT64) {
        v = (float) gguf_get_val_f64(gguf_, id);
    } else {
        DFN_REQUIRE(read_int(gguf_, id, iv), W, "'", path_, "': key '", key, "' is not a number");
        v = (float) iv;
    }
    // No hparam of ours means anything as NaN or infinity; they would only surface later as
    // NaN logits or as a ggml assert.
    DFN_REQUIRE(std::isfinite(v), W, "'", path_, "': key '", key, "' = ", v, " is not a finite number");
    return v;
}

float gguf_file::get_f32(const std::string & key, float def) const {
    return has_key(key) ? get_f32(key) : def;
}

bool gguf_file::get_bool(const std::string & key, bool def) const {
    const int64_t id = key_id(key);
    if (id < 0) return def;
    DFN_REQUIRE(gguf_get_kv_type(gguf_, id) == GGUF_TYPE_BOOL, W, "'", path_, "': key '", key, "' is not a bool");
    return gguf_get_val_bool(gguf_, id);
}

std::string gguf_file::get_str(const std::string & key) const {
    const int64_t id = key_id(key);
    DFN_REQUIRE(id >= 0, W, "'", path_, "': missing key '", key, "'");
    DFN_REQUIRE(gguf_get_kv_type(gguf_, id) == GGUF_TYPE_STRING, W, "'", path_, "': key '", key, "' is not a string");
    return gguf_get_val_str(gguf_, id);
}

std::string gguf_file::get_str(const std::string & key, const std::string & def) const {
    return has_key(key) ? get_str(key) : def;
}

std::vector<int64_t> gguf_file::get_int_arr(const std::string & key) const {
    std::vector<int64_t> out;
    const int64_t id = key_id(key);
    if (id < 0) return out;
    if (gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) {
        int64_t v = 0;
        DFN_REQUIRE(read_int(gguf_, id, v), W, "'", path_, "': key '", key, "' is not an integer array");
        out.push_back(v);
        return out;
    }
    const gguf_type type = gguf_get_arr_type(gguf_, id);
    // gguf_get_arr_data asserts on string arrays: look at the element type first.
    DFN_REQUIRE(type != GGUF_TYPE_STRING, W, "'", path_, "': key '", key, "' is not an integer array");
    const size_t n = gguf_get_arr_n(gguf_, id);
    const void * data = gguf_get_arr_data(gguf_, id);
    switch (type) {
        case GGUF_TYPE_INT32:  for (size_t i = 0; i < n; ++i) out.push_back(((const int32_t *) data)[i]); break;
        case GGUF_TYPE_UINT32: for (size_t i = 0; i < n; ++i) out.push_back(((const uint32_t *) data)[i]); break;
        case GGUF_TYPE_INT64:  for (size_t i = 0; i < n; ++i) out.push_back(((const int64_t *) data)[i]); break;
        case GGUF_TYPE_UINT64: for (size_t i = 0; i < n; ++i) out.push_back((int64_t) ((const uint64_t *) data)[i]); break;
        case GGUF_TYPE_BOOL:   for (size_t i = 0; i < n; ++i) out.push_back(((const int8_t *) data)[i] ? 1 : 0); break;
        default: throw input_error(cat("[", W, "] '", path_, "': key '", key, "' is not an integer array"));
    }
    return out;
}

std::vector<std::string> gguf_file::get_str_arr(const std::string & key) const {
    const int64_t id = key_id(key);
    DFN_REQUIRE(id >= 0, W, "'", path_, "': missing key '", key, "'");
    DFN_REQUIRE(arr_type(key) == GGUF_TYPE_STRING, W, "'", path_, "': key '", key, "' is not a string array");
    const size_t n = gguf_get_arr_n(gguf_, id);
    std::vector<std::string> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = gguf_get_arr_str(gguf_, id, i);
    return out;
}

int64_t gguf_file::arr_len(const std::string & key) const {
    const int64_t id = key_id(key);
    if (id < 0 || gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) return -1;
    return (int64_t) gguf_get_arr_n(gguf_, id);
}

std::vector<std::string> gguf_file::keys_with_prefix(const std::string & prefix) const {
    std::vector<std::string> out;
    const int64_t n = gguf_get_n_kv(gguf_);
    for (int64_t i = 0; i < n; ++i) {
        const char * k = gguf_get_key(gguf_, i);
        if (strncmp(k, prefix.c_str(), prefix.size()) == 0) out.emplace_back(k);
    }
    return out;
}

// The rule of tensor_role (gguf_file.h): F32, or a type with both a dequantization and a CPU dot
// product. Every role needs both: ggml_get_rows dequantizes rows, ggml_mul_mat multiplies
// (activations quantized to the type's vec_dot_type), and F32 roles convert at load.
static bool cpu_weight_type(ggml_type type) {
    if (type == GGML_TYPE_F32) return true;
    if ((int) type < 0 || (int) type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) return false;  // removed ids
    return ggml_get_type_traits(type)->to_float != nullptr && ggml_get_type_traits_cpu(type)->vec_dot != nullptr;
}

static std::string type_str(ggml_type type) {
    const bool known = (int) type >= 0 && (int) type < GGML_TYPE_COUNT && ggml_blck_size(type) != 0;
    return known ? std::string(ggml_type_name(type)) : cat("id ", (int) type, " (not a ggml type)");
}

void gguf_file::check_type(ggml_tensor * t, tensor_role role) {
    auto conv = to_f32_.find(t->name);
    const ggml_type type = conv != to_f32_.end() ? conv->second : t->type;  // as stored in the file
    static const char * what[] = {"a matmul weight", "an embedding", "a norm or vector weight"};
    DFN_REQUIRE(cpu_weight_type(type), W, "'", path_, "': tensor '", t->name, "' has type ", type_str(type),
                ", which ", what[role], " cannot have: it must be f32 or a float or quantized type that ggml's CPU",
                " backend can dequantize and multiply (f16, bf16, q4_0 .. q8_0, k-quants, ...)");
    if (role != TENSOR_ROLE_F32 || t->type == GGML_TYPE_F32) return;
    DFN_REQUIRE(buf_ == nullptr, W, "tensor '", t->name, "' given a role after its data was loaded");
    to_f32_[t->name] = t->type;
    t->type = GGML_TYPE_F32;
    t->nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; ++i) t->nb[i] = t->nb[i - 1] * t->ne[i - 1];
}

ggml_tensor * gguf_file::tensor(const std::string & name, std::vector<int64_t> ne, tensor_role role, bool required) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
        DFN_REQUIRE(!required, W, "'", path_, "': missing tensor '", name, "'");
        return nullptr;
    }
    ggml_tensor * t = it->second;
    check_type(t, role);
    if (ne.empty()) return t;  // shape checked by the caller
    bool ok = true;
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        const int64_t want = i < (int) ne.size() ? ne[i] : 1;
        ok = ok && t->ne[i] == want;
    }
    if (!ok) {
        std::string want = "[", got = "[";
        for (size_t i = 0; i < ne.size(); ++i) want += cat(i ? ", " : "", ne[i]);
        for (int i = 0; i < ggml_n_dims(t); ++i) got += cat(i ? ", " : "", t->ne[i]);
        throw input_error(cat("[", W, "] '", path_, "': tensor '", name, "' has shape ", got, "], expected ", want, "]"));
    }
    return t;
}

// Weights are streamed once per forward; on 4 KiB pages every 4 KiB of them is a TLB miss, and the
// hardware prefetchers stop at each page boundary. Ask for 2 MiB pages (transparent huge pages in
// "madvise" mode, the common default) before the weights are written: AR decode measured ~2-7%
// faster on this machine (bench/README.md). A no-op where the kernel says no.
static void advise_huge_pages(void * base, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = 2u << 20;
    const uintptr_t b = ((uintptr_t) base + huge - 1) & ~(huge - 1), e = ((uintptr_t) base + size) & ~(huge - 1);
    if (e > b) madvise((void *) b, e - b, MADV_HUGEPAGE);
#else
    (void) base;
    (void) size;
#endif
}

void gguf_file::load_weights(ggml_backend_buffer_type_t buft, bool use_mmap) {
    DFN_REQUIRE(buf_ == nullptr, W, "weights already loaded");
    if (use_mmap && map_weights(buft)) return;
    read_weights(buft);
}

ggml_type gguf_file::file_type(const ggml_tensor * t) const {
    auto conv = to_f32_.find(t->name);
    return conv != to_f32_.end() ? conv->second : t->type;
}

void gguf_file::set_converted(ggml_tensor * t, const void * file_bytes) {
    std::vector<float> f32((size_t) ggml_nelements(t));
    ggml_get_type_traits(file_type(t))->to_float(file_bytes, f32.data(), ggml_nelements(t));
    ggml_backend_tensor_set(t, f32.data(), 0, ggml_nbytes(t));
}

bool gguf_file::map_weights(ggml_backend_buffer_type_t buft) {
#ifdef DFN_HAVE_MMAP
    if (!ggml_backend_buft_is_host(buft)) return false;
    // host memory is the CPU device's (ggml's CPU buffer type names no device)
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (dev == nullptr) return false;
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (!props.caps.buffer_from_host_ptr) return false;
    // ggml's CPU buffers hold tensors 32-byte aligned (GGUF's default general.alignment): a file
    // with another alignment is read instead
    const size_t data_off = gguf_get_data_offset(gguf_);
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        if ((data_off + gguf_get_tensor_offset(gguf_, i)) % 32 != 0) return false;
    }

    const int fd = open(path_.c_str(), O_RDONLY);
    DFN_REQUIRE(fd >= 0, W, "cannot open '", path_, "'");
    struct stat st;
    const bool sized = fstat(fd, &st) == 0 && st.st_size > 0;
    int flags = MAP_SHARED;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;  // read ahead now, as llama.cpp does: the first forward pass takes no page faults
#endif
    void * p = sized ? mmap(nullptr, (size_t) st.st_size, PROT_READ, flags, fd, 0) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) {
        if (errno == ENOMEM) throw memory_error(cat("[", W, "] out of address space mapping '", path_, "'"));
        return false;  // a file system that cannot map: read it
    }
    map_ = p;
    map_size_ = (size_t) st.st_size;

    buf_ = ggml_backend_dev_buffer_from_host_ptr(dev, map_, map_size_, map_size_);
    if (!buf_) throw runtime_error(cat("[", W, "] cannot wrap the mapping of '", path_, "' in a ggml buffer"));
    ggml_backend_buffer_set_usage(buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    // converted tensors (TENSOR_ROLE_F32 stored in another type) need memory of their own
    size_t copy_bytes = 0;
    const size_t align = 64;
    for (const auto & kv : to_f32_) copy_bytes += GGML_PAD(ggml_nbytes(tensors_.at(kv.first)), align);
    if (copy_bytes > 0) {
        copies_ = ggml_backend_buft_alloc_buffer(buft, copy_bytes);
        if (!copies_) throw memory_error(cat("[", W, "] out of memory for the converted tensors of '", path_, "'"));
        ggml_backend_buffer_set_usage(copies_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    char * copy_at = copies_ ? (char *) ggml_backend_buffer_get_base(copies_) : nullptr;
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor * t = tensors_.at(gguf_get_tensor_name(gguf_, i));
        char * bytes = (char *) map_ + data_off + gguf_get_tensor_offset(gguf_, i);
        const bool converted = file_type(t) != t->type;
        void * addr = converted ? (void *) copy_at : (void *) bytes;
        DFN_REQUIRE(ggml_backend_tensor_alloc(converted ? copies_ : buf_, t, addr) == GGML_STATUS_SUCCESS, W,
                    "cannot place tensor '", t->name, "' of '", path_, "'");
        if (converted) {
            set_converted(t, bytes);
            copy_at += GGML_PAD(ggml_nbytes(t), align);
        } else {
            mapped_bytes_ += ggml_nbytes(t);
        }
    }
    return true;
#else
    (void) buft;
    return false;
#endif
}

void gguf_file::load_weights(const placement & place, bool use_mmap) {
    DFN_REQUIRE(buf_ == nullptr, W, "weights already loaded");
    std::vector<ggml_tensor *> all = tensors();
    ggml_backend_buffer_type_t first = all.empty() ? nullptr : place(all.front());
    bool one = true;
    for (ggml_tensor * t : all) one = one && place(t) == first;
    if (one) {
        load_weights(first, use_mmap);
        return;
    }
    std::vector<ggml_backend_buffer_t> bufs = alloc_tensors_placed(all, place, W, cat("the weights of '", path_, "'"));
    buf_ = bufs.front();
    more_bufs_.assign(bufs.begin() + 1, bufs.end());
    for (ggml_backend_buffer_t b : bufs) ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    read_tensors();
}

void gguf_file::read_weights(ggml_backend_buffer_type_t buft) {
    buf_ = alloc_ctx_tensors(ctx_, buft, W, cat("the weights of '", path_, "'"));
    ggml_backend_buffer_set_usage(buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (ggml_backend_buffer_is_host(buf_)) {
        advise_huge_pages(ggml_backend_buffer_get_base(buf_), ggml_backend_buffer_get_size(buf_));
    }
    read_tensors();
}

void gguf_file::read_tensors() {
    std::unique_ptr<FILE, int (*)(FILE *)> f(fopen(path_.c_str(), "rb"), fclose);
    DFN_REQUIRE(f != nullptr, W, "cannot open '", path_, "'");
    const size_t data_off = gguf_get_data_offset(gguf_);
    std::vector<uint8_t> staging;
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor * t = tensors_.at(gguf_get_tensor_name(gguf_, i));
        const ggml_type ft = file_type(t);
        const size_t n = ggml_row_size(ft, t->ne[0]) * ggml_nrows(t);  // bytes in the file
        DFN_REQUIRE(fseeko(f.get(), (off_t) (data_off + gguf_get_tensor_offset(gguf_, i)), SEEK_SET) == 0, W,
                    "seek failed in '", path_, "'");
        const bool direct = ggml_backend_buffer_is_host(t->buffer) && ft == t->type;
        void * dst = t->data;
        if (!direct) { staging.resize(n); dst = staging.data(); }
        DFN_REQUIRE(fread(dst, 1, n, f.get()) == n, W, "'", path_, "' is truncated at tensor '", t->name, "'");
        if (direct) continue;
        if (ft != t->type) set_converted(t, staging.data());  // a TENSOR_ROLE_F32 tensor stored as F16, BF16, ...
        else ggml_backend_tensor_set(t, staging.data(), 0, ggml_nbytes(t));
    }
}

size_t gguf_file::weights_bytes() const {
    size_t n = 0;
    for (const auto & kv : tensors_) n += ggml_nbytes(kv.second);
    return n;
}

}  // namespace dfn
