// The product's GDN rollback: replay the kept prefix of the verify's tape (rollback.h).
#include "runtime/rollback.h"

#include "ggml.h"

namespace dfn {

namespace {

class tape_rollback final : public gdn_rollback {
public:
    const char * name() const override { return "tape"; }
    bool supports_tree() const override { return true; }

    // the verify left the state alone; the next graph's GDN op replays the kept tape first
    bool restore_host(gdn_layer &, int64_t, int64_t) const override { return true; }

    // the state before the verify through the kept prefix of the tape, with the same
    // ggml_gated_delta_net the AR step runs (the tape holds its inputs: graph.cpp, gdn_device_record)
    void restore_device(const build_context & b, const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep,
                        int64_t) const override {
        ggml_context * ctx = b.ctx;
        const size_t es = sizeof(float);
        const int64_t H_k = L.tape_k_heads, n_state = S * S * H_v;
        ggml_tensor * k = ggml_view_4d(ctx, L.tape_k, S, H_k, n_keep, 1, S * es, S * H_k * es, S * H_k * n_keep * es, 0);
        ggml_tensor * v = ggml_view_4d(ctx, L.tape_u, S, H_v, n_keep, 1, S * es, S * H_v * es, S * H_v * n_keep * es, 0);
        ggml_tensor * gt = ggml_view_4d(ctx, L.tape_g, 1, H_v, n_keep, 1, es, H_v * es, H_v * n_keep * es, 0);
        ggml_tensor * bt = ggml_view_4d(ctx, L.tape_beta, 1, H_v, n_keep, 1, es, H_v * es, H_v * n_keep * es, 0);
        ggml_tensor * state = ggml_reshape_4d(ctx, L.ssm, S, S, H_v, 1);
        // q does not touch the state: k stands in for it (the outputs are not read)
        ggml_tensor * res = ggml_gated_delta_net(ctx, k, k, v, gt, bt, state, 1);
        ggml_tensor * fin = ggml_view_1d(ctx, res, n_state, S * H_v * n_keep * es);
        ggml_build_forward_expand(b.gf, ggml_cpy(ctx, fin, ggml_reshape_1d(ctx, L.ssm, n_state)));
    }
};

}  // namespace

std::unique_ptr<gdn_rollback> make_gdn_rollback(rollback_kind kind) {
    switch (kind) {
        case ROLLBACK_SNAPSHOT: return make_snapshot_rollback();
        case ROLLBACK_REDECODE: return make_redecode_rollback();
        case ROLLBACK_TAPE: break;
    }
    return std::make_unique<tape_rollback>();
}

}  // namespace dfn
