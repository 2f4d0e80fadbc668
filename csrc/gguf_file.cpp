#include "gguf_file.h"

#include "alloc.h"
#include "common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

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
    if (ctx_) ggml_free(ctx_);
    if (gguf_) gguf_free(gguf_);
}

int64_t gguf_file::key_id(const std::string & key) const { return gguf_find_key(gguf_, key.c_str()); }

bool gguf_file::has_key(const std::string & key) const { return key_id(key) >= 0; }

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
    if (t == GGUF_TYPE_FLOAT32) return gguf_get_val_f32(gguf_, id);
    if (t == GGUF_TYPE_FLOAT64) return (float) gguf_get_val_f64(gguf_, id);
    int64_t v = 0;
    DFN_REQUIRE(read_int(gguf_, id, v), W, "'", path_, "': key '", key, "' is not a number");
    return (float) v;
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
    const size_t n = gguf_get_arr_n(gguf_, id);
    const void * data = gguf_get_arr_data(gguf_, id);
    switch (gguf_get_arr_type(gguf_, id)) {
        case GGUF_TYPE_INT32:  for (size_t i = 0; i < n; ++i) out.push_back(((const int32_t *) data)[i]); break;
        case GGUF_TYPE_UINT32: for (size_t i = 0; i < n; ++i) out.push_back(((const uint32_t *) data)[i]); break;
        case GGUF_TYPE_INT64:  for (size_t i = 0; i < n; ++i) out.push_back(((const int64_t *) data)[i]); break;
        case GGUF_TYPE_UINT64: for (size_t i = 0; i < n; ++i) out.push_back((int64_t) ((const uint64_t *) data)[i]); break;
        case GGUF_TYPE_BOOL:   for (size_t i = 0; i < n; ++i) out.push_back(((const int8_t *) data)[i] ? 1 : 0); break;
        default: throw input_error(cat("[", W, "] '", path_, "': key '", key, "' is not an integer array"));
    }
    return out;
}

int64_t gguf_file::arr_len(const std::string & key) const {
    const int64_t id = key_id(key);
    if (id < 0 || gguf_get_kv_type(gguf_, id) != GGUF_TYPE_ARRAY) return -1;
    return (int64_t) gguf_get_arr_n(gguf_, id);
}

ggml_tensor * gguf_file::tensor(const std::string & name, std::vector<int64_t> ne, bool required) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
        DFN_REQUIRE(!required, W, "'", path_, "': missing tensor '", name, "'");
        return nullptr;
    }
    ggml_tensor * t = it->second;
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

void gguf_file::load_weights(ggml_backend_buffer_type_t buft) {
    DFN_REQUIRE(buf_ == nullptr, W, "weights already loaded");
    buf_ = alloc_ctx_tensors(ctx_, buft, W, cat("the weights of '", path_, "'"));
    ggml_backend_buffer_set_usage(buf_, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (ggml_backend_buffer_is_host(buf_)) {
        advise_huge_pages(ggml_backend_buffer_get_base(buf_), ggml_backend_buffer_get_size(buf_));
    }

    std::unique_ptr<FILE, int (*)(FILE *)> f(fopen(path_.c_str(), "rb"), fclose);
    DFN_REQUIRE(f != nullptr, W, "cannot open '", path_, "'");
    const size_t data_off = gguf_get_data_offset(gguf_);
    const bool host = ggml_backend_buffer_is_host(buf_);
    std::vector<uint8_t> staging;
    const int64_t n_tensors = gguf_get_n_tensors(gguf_);
    for (int64_t i = 0; i < n_tensors; ++i) {
        ggml_tensor * t = tensors_.at(gguf_get_tensor_name(gguf_, i));
        const size_t n = ggml_nbytes(t);
        DFN_REQUIRE(fseeko(f.get(), (off_t) (data_off + gguf_get_tensor_offset(gguf_, i)), SEEK_SET) == 0, W,
                    "seek failed in '", path_, "'");
        void * dst = t->data;
        if (!host) { staging.resize(n); dst = staging.data(); }
        DFN_REQUIRE(fread(dst, 1, n, f.get()) == n, W, "'", path_, "' is truncated at tensor '", t->name, "'");
        if (!host) ggml_backend_tensor_set(t, staging.data(), 0, n);
    }
}

size_t gguf_file::weights_bytes() const {
    size_t n = 0;
    for (const auto & kv : tensors_) n += ggml_nbytes(kv.second);
    return n;
}

}  // namespace dfn
