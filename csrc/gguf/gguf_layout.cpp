#include "gguf/gguf_layout.h"

#include "base/common.h"

#include "ggml.h"
#include "gguf.h"

#include <cstdio>
#include <memory>
#include <set>
#include <vector>

namespace dfn {

static const char * W = "load_gguf";

namespace {

// Sequential reads with the position and the bytes left always known.
struct reader {
    FILE * f;
    std::string path;
    uint64_t size, pos = 0;

    [[noreturn]] void fail(const std::string & where, const std::string & what) const {
        throw input_error(cat("[", W, "] '", path, "': ", where, ": ", what, " (at byte ", pos, " of ", size, ")"));
    }
    // A field that does not fit in the file: a cut-off file, or a corrupt length before it.
    [[noreturn]] void past_end(const std::string & where, const std::string & what) const {
        throw input_error(cat("[", W, "] '", path, "' is truncated or corrupt: ", where, ": ", what,
                              " runs past the end of the file (at byte ", pos, " of ", size, ")"));
    }
    uint64_t left() const { return size - pos; }

    template <typename T> T get(const std::string & where, const char * field) {
        T v;
        if (left() < sizeof(T) || fread(&v, sizeof(T), 1, f) != 1) past_end(where, field);
        pos += sizeof(T);
        return v;
    }
    void skip(uint64_t n, const std::string & where, const char * field) {
        if (n > left()) past_end(where, cat(field, " of ", n, " bytes"));
        if (fseeko(f, (off_t) n, SEEK_CUR) != 0) fail(where, "seek failed");
        pos += n;
    }
    std::string str(const std::string & where, const char * field, uint64_t max_len) {
        const uint64_t n = get<uint64_t>(where, field);
        if (n > left()) past_end(where, cat(field, " of length ", n));
        if (n > max_len) fail(where, cat(field, " length ", n, " exceeds ", max_len));
        std::string s(n, '\0');
        if (n && fread(&s[0], 1, n, f) != n) fail(where, cat(field, " cannot be read"));
        pos += n;
        return s;
    }
};

// Bytes of one value of a fixed-size GGUF type; 0 for strings, arrays and unknown types.
size_t gguf_scalar_size(uint32_t t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

// One metadata pair; returns the key (and general.alignment's value in *alignment).
std::string check_kv(reader & r, int64_t i, uint64_t & alignment) {
    const std::string at = cat("metadata pair ", i);
    const std::string key = r.str(at, "key", 65535);
    if (key.empty()) r.fail(at, "empty key");
    const std::string where = cat("key '", key, "'");
    uint32_t type = r.get<uint32_t>(where, "value type");
    uint64_t n = 1;
    const bool is_array = type == GGUF_TYPE_ARRAY;
    if (is_array) {
        type = r.get<uint32_t>(where, "array element type");
        n = r.get<uint64_t>(where, "array length");
    }
    if (type == GGUF_TYPE_STRING) {
        if (n > r.left() / 8) r.past_end(where, cat("array of ", n, " strings"));
        for (uint64_t k = 0; k < n; ++k) {
            const uint64_t len = r.get<uint64_t>(where, "string length");
            r.skip(len, is_array ? cat(where, " [", k, "]") : where, "string");
        }
        return key;
    }
    const size_t es = gguf_scalar_size(type);
    if (es == 0) r.fail(where, cat("unknown ", is_array ? "array element" : "value", " type ", type));
    if (n > r.left() / es) r.past_end(where, cat("array of ", n, " x ", es, "-byte values"));
    if (key == "general.alignment") {
        if (is_array || type != GGUF_TYPE_UINT32) r.fail(where, "must be a uint32");
        alignment = r.get<uint32_t>(where, "value");
        if (alignment == 0 || (alignment & (alignment - 1)) != 0) r.fail(where, cat(alignment, " is not a power of 2"));
        return key;
    }
    r.skip(n * es, where, "value");
    return key;
}

struct tensor_extent {
    std::string name;
    uint64_t offset, nbytes;
};

tensor_extent check_tensor_info(reader & r, int64_t i) {
    const std::string at = cat("tensor info ", i);
    tensor_extent t;
    t.name = r.str(at, "name", GGML_MAX_NAME - 1);
    const std::string where = cat("tensor '", t.name, "'");
    const uint32_t n_dims = r.get<uint32_t>(where, "dimension count");
    if (n_dims > GGML_MAX_DIMS) r.fail(where, cat(n_dims, " dimensions, at most ", GGML_MAX_DIMS));
    int64_t ne[GGML_MAX_DIMS] = {1, 1, 1, 1};
    int64_t n_el = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
        ne[d] = r.get<int64_t>(where, "dimension");
        if (ne[d] < 0) r.fail(where, cat("dimension ", d, " is ", ne[d]));
        if (ne[d] > 0 && n_el > INT64_MAX / ne[d]) r.fail(where, "element count overflows");
        n_el *= ne[d];
    }
    const int32_t type = r.get<int32_t>(where, "type");
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) type) == 0 || ggml_type_size((ggml_type) type) == 0)
        r.fail(where, cat("unknown tensor type ", type));
    const int64_t blck = ggml_blck_size((ggml_type) type);
    if (ne[0] % blck != 0) r.fail(where, cat("rows of ", ne[0], " are not whole ", ggml_type_name((ggml_type) type), " blocks of ", blck));
    const uint64_t n_blocks = (uint64_t) n_el / blck, bs = ggml_type_size((ggml_type) type);
    if (n_blocks > UINT64_MAX / 2 / bs) r.fail(where, "byte size overflows");
    t.nbytes = n_blocks * bs;
    t.offset = r.get<uint64_t>(where, "data offset");
    return t;
}

}  // namespace

void check_gguf_layout(const std::string & path, uint64_t file_size) {
    std::unique_ptr<FILE, int (*)(FILE *)> f(fopen(path.c_str(), "rb"), fclose);
    DFN_REQUIRE(f != nullptr, W, "cannot open '", path, "'");
    reader r{f.get(), path, file_size};
    r.get<uint32_t>("header", "magic");
    const uint32_t version = r.get<uint32_t>("header", "version");
    if (version < 2 || version > GGUF_VERSION) r.fail("header", cat("GGUF version ", version, " (supported: 2..", GGUF_VERSION, ")"));
    // Each tensor info takes >= 8 + 4 + 4 + 8 bytes and each pair >= 8 + 1 + 4 + 1: counts past what the
    // file could hold are corrupt before anything is read for them.
    const int64_t n_tensors = r.get<int64_t>("header", "tensor count");
    const int64_t n_kv = r.get<int64_t>("header", "metadata count");
    if (n_tensors < 0) r.fail("header", cat("tensor count ", n_tensors));
    if (n_kv < 0) r.fail("header", cat("metadata count ", n_kv));
    if ((uint64_t) n_tensors > r.left() / 24) r.past_end("header", cat(n_tensors, " tensor infos of >= 24 bytes"));
    if ((uint64_t) n_kv > r.left() / 14) r.past_end("header", cat(n_kv, " metadata pairs of >= 14 bytes"));

    uint64_t alignment = GGUF_DEFAULT_ALIGNMENT;
    std::set<std::string> seen;
    for (int64_t i = 0; i < n_kv; ++i) {
        const std::string key = check_kv(r, i, alignment);
        if (!seen.insert(key).second) r.fail(cat("key '", key, "'"), "appears twice");
    }
    seen.clear();
    std::vector<tensor_extent> ts;
    for (int64_t i = 0; i < n_tensors; ++i) {
        ts.push_back(check_tensor_info(r, i));
        if (!seen.insert(ts.back().name).second) r.fail(cat("tensor '", ts.back().name, "'"), "appears twice");
    }

    // ggml's layout: the data section starts at the next multiple of the alignment, and tensors
    // follow each other in order, each padded to the alignment.
    const uint64_t data = (r.pos + alignment - 1) / alignment * alignment;
    uint64_t expect = 0;
    for (const auto & t : ts) {
        if (t.offset != expect)
            r.fail(cat("tensor '", t.name, "'"), cat("data offset ", t.offset, ", expected ", expect,
                                                     " (tensors are stored in order, aligned to ", alignment, ")"));
        if (t.nbytes > file_size || data + t.offset > file_size - t.nbytes)
            throw input_error(cat("[", W, "] '", path, "' is truncated: tensor '", t.name, "' ends at byte ",
                                  data + t.offset + t.nbytes, " but the file has ", file_size, " bytes"));
        expect = t.offset + (t.nbytes + alignment - 1) / alignment * alignment;
    }
}

}  // namespace dfn
