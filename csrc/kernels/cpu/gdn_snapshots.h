// The snapshot-rollback baseline's GDN recording (Engine.for_benchmark(rollback="snapshot"),
// bench/rollback.py; runtime/rollback.h picks it): the tape record op that also stores the state
// after every token, which the commit copies back instead of replaying the tape. A benchmark
// baseline, not on the product path: the product's record op is gdn_tape_record_op (gdn_tape.h).
#pragma once

#include "ggml.h"

namespace dfn {

// As gdn_tape_record_op with null tape tensors (the result packs [o S*H_v*T | tape k S*H_v*T |
// tape u S*H_v*T | tape g H_v*T]), and the state after token t of head h written to
// snapshots (F32 [S*S*H_v, >= T]) at (t * H_v + h) * S * S.
ggml_tensor * gdn_snapshot_record_op(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                                     ggml_tensor * g, ggml_tensor * beta, ggml_tensor * state, ggml_tensor * snapshots);

}  // namespace dfn
