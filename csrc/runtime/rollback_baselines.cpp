// The benchmark baselines of GDN rollback (rollback.h), which bench/rollback.py measures against
// the tape replay. Not on the product path: Engine.for_benchmark(rollback="snapshot"|"redecode").
#include "runtime/rollback.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstring>

namespace dfn {

namespace {

// The state after every verified token is kept (the verify's record op writes it:
// gdn_snapshots.h), and the one after the last kept token is copied back.
class snapshot_rollback final : public gdn_rollback {
public:
    const char * name() const override { return "snapshot"; }
    bool keeps_snapshots() const override { return true; }

    bool restore_host(gdn_layer & L, int64_t n_keep, int64_t) const override {
        const size_t bytes = ggml_nbytes(L.ssm);
        std::memcpy(L.ssm->data, (const char *) L.snapshots->data + (n_keep - 1) * bytes, bytes);
        return false;
    }

    // slot s of ggml's snapshots is the state s tokens before the last verified one
    void restore_device(const build_context & b, const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep,
                        int64_t n_verified) const override {
        const int64_t n_state = S * S * H_v, slot = n_verified - n_keep;
        ggml_tensor * snap = ggml_view_1d(b.ctx, L.snapshots, n_state, slot * n_state * sizeof(float));
        ggml_build_forward_expand(b.gf, ggml_cpy(b.ctx, snap, ggml_reshape_1d(b.ctx, L.ssm, n_state)));
    }
};

// The GDN state is still the one before the verify; the session runs the kept tokens again.
class redecode_rollback final : public gdn_rollback {
public:
    const char * name() const override { return "redecode"; }
    bool redecodes() const override { return true; }
    bool restore_host(gdn_layer &, int64_t, int64_t) const override { return false; }
    void restore_device(const build_context &, const gdn_layer &, int64_t, int64_t, int64_t, int64_t) const override {}
};

}  // namespace

std::unique_ptr<gdn_rollback> make_snapshot_rollback() { return std::make_unique<snapshot_rollback>(); }
std::unique_ptr<gdn_rollback> make_redecode_rollback() { return std::make_unique<redecode_rollback>(); }

}  // namespace dfn
