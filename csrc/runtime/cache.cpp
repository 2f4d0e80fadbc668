#include "runtime/cache.h"

#include "base/alloc.h"
#include "base/common.h"

#include <unordered_map>

namespace dfn {

model_cache::model_cache(const target_hparams & hp, int64_t n_ctx_, ggml_type kv_type_, int64_t n_tape_,
                         bool snapshots, bool device_tape,
                         const std::function<ggml_backend_buffer_type_t(int)> & layer_buft)
    : n_ctx(n_ctx_), n_tape(n_tape_), kv_type(kv_type_) {
    const size_t n_tensors = 8 * (size_t) hp.n_layer;
    ctx_.reset(init_meta_ctx(n_tensors, "cache"));
    kv.resize(hp.n_layer);
    gdn.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        if (hp.layer_is_gdn(il)) {
            gdn[il].conv = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, hp.ssm_d_conv - 1, hp.ssm_conv_channels());
            gdn[il].ssm = ggml_new_tensor_3d(ctx_.get(), GGML_TYPE_F32, hp.ssm_head_dim, hp.ssm_head_dim, hp.ssm_n_v_heads);
            ggml_format_name(gdn[il].conv, "cache.conv.%d", il);
            ggml_format_name(gdn[il].ssm, "cache.ssm.%d", il);
            if (n_tape > 0) {
                const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads;
                gdn[il].tape_k = ggml_new_tensor_3d(ctx_.get(), GGML_TYPE_F32, S, H_v, n_tape);
                gdn[il].tape_u = ggml_new_tensor_3d(ctx_.get(), GGML_TYPE_F32, S, H_v, n_tape);
                gdn[il].tape_g = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, H_v, n_tape);
                gdn[il].tape_qkv = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, hp.ssm_conv_channels(), n_tape);
                if (device_tape) gdn[il].tape_beta = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, H_v, n_tape);
                if (snapshots) gdn[il].snapshots = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, S * S * H_v, n_tape);
            }
        } else {
            kv[il].k = ggml_new_tensor_3d(ctx_.get(), kv_type, hp.head_dim, hp.n_head_kv, n_ctx);
            kv[il].v = ggml_new_tensor_3d(ctx_.get(), kv_type, hp.head_dim, hp.n_head_kv, n_ctx);
            ggml_format_name(kv[il].k, "cache.k.%d", il);
            ggml_format_name(kv[il].v, "cache.v.%d", il);
        }
    }
    std::vector<ggml_tensor *> all;
    std::unordered_map<const ggml_tensor *, int> layer;
    for (int il = 0; il < hp.n_layer; ++il) {
        for (ggml_tensor * t : {kv[il].k, kv[il].v, gdn[il].conv, gdn[il].ssm, gdn[il].tape_k, gdn[il].tape_u, gdn[il].tape_g,
                                gdn[il].tape_beta, gdn[il].tape_qkv, gdn[il].snapshots}) {
            if (!t) continue;
            all.push_back(t);
            layer[t] = il;
        }
    }
    for (ggml_backend_buffer_t b : alloc_tensors_placed(
             all, [&](const ggml_tensor * t) { return layer_buft(layer.at(t)); }, "cache",
             cat("the KV/GDN cache (n_ctx = ", n_ctx, ", GDN tape of ", n_tape, " tokens)"))) {
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_COMPUTE);
        bufs_.emplace_back(b);
    }
    clear();
}

void model_cache::clear() {
    // Zero everything: dead K/V rows never reach attention (masked), but zeros keep
    // comparisons of cache contents deterministic.
    for (const ggml_backend_buffer_ptr & b : bufs_) ggml_backend_buffer_clear(b.get(), 0);
    n_past = 0;
    replay_n = 0;
}

size_t model_cache::bytes() const {
    size_t n = 0;
    for (const ggml_backend_buffer_ptr & b : bufs_) n += ggml_backend_buffer_get_size(b.get());
    return n;
}

static size_t nbytes(const ggml_tensor * t) { return t ? ggml_nbytes(t) : 0; }

size_t model_cache::kv_bytes() const {
    size_t n = 0;
    for (const kv_layer & l : kv) n += nbytes(l.k) + nbytes(l.v);
    return n;
}

size_t model_cache::gdn_state_bytes() const {
    size_t n = 0;
    for (const gdn_layer & l : gdn) n += nbytes(l.conv) + nbytes(l.ssm);
    return n;
}

size_t model_cache::gdn_tape_bytes() const {
    size_t n = 0;
    for (const gdn_layer & l : gdn) n += nbytes(l.tape_k) + nbytes(l.tape_u) + nbytes(l.tape_g) + nbytes(l.tape_beta) + nbytes(l.tape_qkv) + nbytes(l.snapshots);
    return n;
}

}  // namespace dfn
