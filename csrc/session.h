// A loaded target plus its sequence state: the unit that runs forward passes.
#pragma once

#include "cache.h"
#include "model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace dfn {

struct session_params {
    int64_t n_ctx = 4096;
    int n_threads = 0;            // 0: all cores
    ggml_type kv_type = GGML_TYPE_F16;
    int64_t n_batch = 512;        // tokens per forward graph; longer inputs run in chunks
    std::string device = "cpu";   // "cpu" or "gpu" (first GPU ggml was built with)
    int64_t max_verify = 0;       // most tokens one verify() may take (sizes the GDN tape); 0: no verify
    // GDN rollback after a verify: "tape" (replay the kept prefix of the tape), or the benchmark
    // baselines "snapshot" (store the state after every verified token, copy one back) and
    // "redecode" (run the kept tokens through the target again).
    std::string rollback = "tape";
    // Weight matmuls on the CPU: "own" (matmul.h: batch-invariant, so a verify pass computes
    // each token as the AR step does; F16/F32 weights) or "ggml" (ggml_mul_mat).
    std::string matmul = "own";
};

struct decode_result {
    std::vector<float> logits;  // [n_rows, n_vocab], rows = all tokens or the last one
    int64_t n_rows = 0;
    std::vector<float> taps;    // [n_tokens, n_taps, n_embd] when taps were asked for
    std::vector<int32_t> argmax;  // [n_rows] when only the greedy tokens were asked for (logits empty)
};

// Attention's key range (the target's KV cache, the drafter's ring) is padded to a multiple of
// this many rows, masked: the graph's sizes, and with them its allocation plan, hold for that
// many tokens instead of changing every step.
constexpr int64_t k_kv_pad = 64;
inline int64_t kv_padded(int64_t n) { return (n + k_kv_pad - 1) / k_kv_pad * k_kv_pad; }

class target_session {
public:
    target_session(const std::string & path, const session_params & params);
    ~target_session();
    target_session(const target_session &) = delete;
    target_session & operator=(const target_session &) = delete;

    // Runs tokens at positions n_past .. n_past + n - 1 and appends them to the cache.
    // argmax_only: the greedy token of each returned row instead of its logits (computed in the
    // graph: the AR loop's step).
    decode_result decode(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers = {},
                         bool argmax_only = false);

    // Verify pass: like decode() with all logits, but GDN layers record their tape instead of
    // updating their state. Must be followed by commit(n_keep) before the next decode or verify.
    // argmax_only: return the greedy token per row instead of the logits (computed in the graph).
    decode_result verify(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers = {},
                         bool argmax_only = false);

    // Keep the first n_keep (1..n) tokens of the pending verify: attention K/V cursor to
    // n_past_before + n_keep; GDN state replayed from the tape; conv state from the tape inputs.
    void commit(int64_t n_keep);
    bool verify_pending() const { return pending_n_ > 0; }

    void reset() { cache_->clear(); pending_n_ = 0; }
    int64_t n_past() const { return cache_->n_past; }

    const target_hparams & hparams() const { return model_->hparams(); }
    const target_model & model() const { return *model_; }
    // The cache as it stands, for inspection: a replay commit() deferred is done first.
    model_cache & cache() {
        flush_replay();
        return *cache_;
    }
    const session_params & params() const { return params_; }
    size_t n_graph_plans() const { return plans_.size(); }
    std::string device_name() const;

    // Builds a graph with `build` in this session's metadata arena, allocates it on this
    // session's backends, calls `set_inputs`, computes, then `read_outputs`. Used by the drafter,
    // which shares the target's embeddings, lm_head and backends.
    //
    // `shape_key` names the graph's structure (which op sequence, which outputs, how many tokens).
    // Each key keeps its own scheduler and allocation plan, so a speculative round, which
    // alternates draft, verify and ring-push graphs, re-plans none of them; ggml's allocator
    // re-plans by itself only when a tensor outgrows its plan (the KV length grows). The least
    // recently used plans are dropped beyond k_max_plans or k_max_plan_bytes of compute buffers.
    void run_graph(const std::string & shape_key, const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                   const std::function<void()> & set_inputs, const std::function<void()> & read_outputs);
    ggml_backend_buffer_type_t buffer_type() const { return ggml_backend_get_default_buffer_type(backend_); }

    // Copies of cache contents as F32 for inspection and tests.
    std::vector<float> read_tensor_f32(const ggml_tensor * t, int64_t n_rows_dim2 = -1) const;

private:
    void replay_state(const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep);
    void flush_replay();  // the replay commit() left to the next graph, done now on the host
    void check_tokens(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers) const;
    void run_chunk(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers,
                   decode_result & out, int64_t tok_offset, int64_t n_total, bool record_tape, bool argmax_only);

    // Declaration order is destruction order reversed: the scheduler goes first, then the
    // buffers (cache, weights), then the backends they live on.
    session_params params_;
    ggml_backend_ptr cpu_;                  // CPU backend
    ggml_backend_ptr gpu_;                  // GPU backend, when device != "cpu"
    ggml_backend_t backend_ = nullptr;      // the main compute backend: gpu_ or cpu_
    std::unique_ptr<target_model> model_;
    std::unique_ptr<model_cache> cache_;
    struct graph_plan {
        ggml_backend_sched_ptr sched;
        uint64_t last_use = 0;
    };
    static constexpr size_t k_max_plans = 32;
    static constexpr size_t k_max_plan_bytes = size_t(512) << 20;
    ggml_backend_sched_t plan_for(const std::string & shape_key, ggml_cgraph * gf);
    // Out of memory these throw memory_error (Python MemoryError), after one retry without the
    // other plans (a cache of compute buffers): a new plan, a graph's buffers, room to compute.
    graph_plan new_plan(const std::string & shape_key, ggml_cgraph * gf);
    ggml_backend_sched_t alloc_graph(const std::string & shape_key, ggml_cgraph * gf, ggml_backend_sched_t sched);
    void make_room(size_t bytes, const std::string & what, const std::string & keep_key);
    std::string broken_;  // set when ggml failed mid-compute in a way that cannot be undone
    std::unordered_map<std::string, graph_plan> plans_;  // shape key -> its scheduler (see run_graph)
    uint64_t plan_clock_ = 0;
    std::vector<uint8_t> meta_;             // graph metadata arena
    size_t max_nodes_ = 0;
    int64_t pending_n_ = 0;       // tokens of an uncommitted verify
    int64_t pending_past_ = 0;    // n_past before it
    std::vector<int32_t> pending_tokens_;  // its tokens (re-decode rollback)
};

}  // namespace dfn
