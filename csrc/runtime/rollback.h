// How a target session takes back the rejected end of a verify from its GDN layers (attention
// only moves its cursor: cache.h). The strategy is chosen once, when the session is built
// (session_params::rollback): the product's tape replay (rollback.cpp), or one of the benchmark
// baselines (rollback_baselines.cpp; Engine.for_benchmark(rollback=...), bench/rollback.py).
// The conv state is the same for every strategy: the session rebuilds it from the kept inputs.
#pragma once

#include "graph/build_context.h"
#include "runtime/cache.h"

#include <cstdint>
#include <memory>

namespace dfn {

// ROLLBACK_TAPE replays the kept prefix of the tape; the baselines ROLLBACK_SNAPSHOT store the
// state after every verified token and copy one back, and ROLLBACK_REDECODE runs the kept tokens
// through the target again.
enum rollback_kind { ROLLBACK_TAPE, ROLLBACK_SNAPSHOT, ROLLBACK_REDECODE };

class gdn_rollback {
public:
    virtual ~gdn_rollback() = default;
    virtual const char * name() const = 0;  // a key part of the commit graph (its plan depends on it)
    // The cache keeps the state after every verified token (gdn_layer::snapshots).
    virtual bool keeps_snapshots() const { return false; }
    // A tree verify can be taken back this way (host caches only: target_session::verify_tree).
    virtual bool supports_tree() const { return false; }
    // The kept tokens run through the target again: the commit does nothing else.
    virtual bool redecodes() const { return false; }
    // Layer L's state in host memory after a verify of n_verified tokens keeping n_keep of them.
    // True: left to the next graph's GDN op, which replays the tape first (cache.h: replay_n).
    virtual bool restore_host(gdn_layer & L, int64_t n_keep, int64_t n_verified) const = 0;
    // The same in device memory, as nodes of b.gf writing L.ssm (S: the head dim, H_v heads).
    virtual void restore_device(const build_context & b, const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep,
                                int64_t n_verified) const = 0;
};

std::unique_ptr<gdn_rollback> make_gdn_rollback(rollback_kind kind);  // rollback_baselines.cpp has the baselines

// The baselines (rollback_baselines.cpp).
std::unique_ptr<gdn_rollback> make_snapshot_rollback();
std::unique_ptr<gdn_rollback> make_redecode_rollback();

}  // namespace dfn
