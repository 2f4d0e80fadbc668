#include "cache.h"

#include "alloc.h"
#include "common.h"

namespace dfn {

model_cache::model_cache(const target_hparams & hp, int64_t n_ctx_, ggml_type kv_type_, int64_t n_tape_,
                         bool snapshots, ggml_backend_buffer_type_t buft)
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
                if (!ggml_backend_buft_is_host(buft)) gdn[il].tape_beta = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, H_v, n_tape);
                if (snapshots) gdn[il].snapshots = ggml_new_tensor_2d(ctx_.get(), GGML_TYPE_F32, S * S * H_v, n_tape);
            }
        } else {
            kv[il].k = ggml_new_tensor_3d(ctx_.get(), kv_type, hp.head_dim, hp.n_head_kv, n_ctx);
            kv[il].v = ggml_new_tensor_3d(ctx_.get(), kv_type, hp.head_dim, hp.n_head_kv, n_ctx);
            ggml_format_name(kv[il].k, "cache.k.%d", il);
            ggml_format_name(kv[il].v, "cache.v.%d", il);
        }
    }
    buf_.reset(alloc_ctx_tensors(ctx_.get(), buft, "cache",
                                 cat("the KV/GDN cache (n_ctx = ", n_ctx, ", GDN tape of ", n_tape, " tokens)")));
    ggml_backend_buffer_set_usage(buf_.get(), GGML_BACKEND_BUFFER_USAGE_COMPUTE);
    clear();
}

void model_cache::clear() {
    // Zero everything: dead K/V rows never reach attention (masked), but zeros keep
    // comparisons of cache contents deterministic.
    ggml_backend_buffer_clear(buf_.get(), 0);
    n_past = 0;
    replay_n = 0;
}

size_t model_cache::bytes() const { return ggml_backend_buffer_get_size(buf_.get()); }

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
