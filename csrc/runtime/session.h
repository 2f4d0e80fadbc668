// A loaded target plus its sequence state: the unit that runs forward passes.
#pragma once

#include "runtime/cache.h"
#include "kernels/cpu/constraint.h"
#include "graph/graph.h"
#include "graph/device_heads.h"
#include "runtime/graph_runner.h"
#include "runtime/rollback.h"
#include "models/model.h"
#include "kernels/cpu/sampler.h"

#include "ggml-backend.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dfn {

// The bindings parse the Python strings ("tape"/..., "own"/"ggml") into these fields; the device
// string goes to the graph runner as it is.
struct session_params {
    int64_t n_ctx = 4096;
    int n_threads = 0;            // 0: all cores
    ggml_type kv_type = GGML_TYPE_F16;
    int64_t n_batch = 512;        // tokens per forward graph; longer inputs run in chunks
    std::string device = "cpu";  // devices.h: resolve_device ("cpu", "gpu", "CUDA0", "rpc://H:P")
    int64_t max_verify = 0;       // most tokens one verify() may take (sizes the GDN tape); 0: no verify
    rollback_kind rollback = ROLLBACK_TAPE;  // rollback.h: the product's tape, or a benchmark baseline
    // Weight matmuls on the CPU: MATMUL_OWN (matmul.h: batch-invariant, so a verify pass computes
    // each token as the AR step does; F16/F32 weights) or MATMUL_GGML (ggml_mul_mat).
    matmul_kind matmul = MATMUL_OWN;
    // Weights (target and drafter) in host memory are the file's pages, mapped (gguf_file.h);
    // false: read into buffers of their own.
    bool use_mmap = true;
    // Sequence slots, each with its own cache (KV, GDN state, tape): decode_batch runs several in one
    // pass. Slot 0 is the sequence decode / verify / commit serve. More than one: CPU, tape rollback.
    int n_seq = 1;
};

// What a target session, and the drafter beside it, hold in memory, in bytes (Engine.memory_report).
// Weights "mapped" are tensors read in place from the mapped GGUF (file pages, shared with the page
// cache, not a copy); "copied" are weights in buffers of their own (the few tensors converted to
// F32 at load, the draft vocabulary's lm_head rows, or all of them when the file is not mapped or
// lives on a GPU). Compute: the graph plans' buffers (activations), which come and go with the
// graph shapes run (graph_runner.h).
struct memory_usage {
    size_t target_weights_mapped = 0, target_weights_copied = 0;
    size_t drafter_weights_mapped = 0, drafter_weights_copied = 0;
    size_t kv_cache = 0;      // attention K/V over n_ctx
    size_t gdn_state = 0;     // GDN recurrent + conv state
    size_t gdn_tape = 0;      // GDN tape of one verify (max_verify tokens)
    size_t feature_ring = 0;  // drafter-context K/V, capacity + block scratch
    size_t feature_queue = 0; // host: the target taps queued for the ring (at most capacity + max(1, capacity / 8)
                              // rows, spec.cpp: queue_features; 1.125x the ring's capacity from 8 rows on)
    size_t compute_target = 0, compute_drafter = 0;
    size_t on_device = 0;     // of the above, the bytes held by a device other than the CPU (0 on the CPU)
};

struct decode_result {
    std::vector<float> logits;  // [n_rows, n_vocab], rows = all tokens or the last one
    int64_t n_rows = 0;
    std::vector<float> taps;    // [n_tokens, n_taps, n_embd] when taps were asked for
    std::vector<int32_t> argmax;  // [n_rows] when only the greedy tokens were asked for (logits empty)
};

// Row i's greedy token from a pass: its in-graph argmax when the pass computed those, else the
// row's first maximum (choose_token at temperature 0: the token the in-graph argmax takes), for a
// token at position pos.
int32_t greedy_of(const decode_result & v, int64_t i, int64_t n_vocab, int64_t pos, const char * where);

// Attention's key range (the target's KV cache, the drafter's ring) is padded to a multiple of
// this many rows, masked: the graph's sizes, and with them its allocation plan, hold for that
// many tokens instead of changing every step.
constexpr int64_t k_kv_pad = 64;
inline int64_t kv_padded(int64_t n) { return (n + k_kv_pad - 1) / k_kv_pad * k_kv_pad; }

// Most tokens one speculative round may verify (Engine(block_size=...)): the GDN tape, the
// verify graph and the drafter's block scale with it, and a drafter gains nothing past its
// trained block size (DFlash drafters train with 16), so larger values only waste time and memory.
constexpr int64_t k_max_block_size = 64;

// One sequence's work in a decode_batch: prompt tokens that fill its cache (no logits), an AR step
// or the last prompt chunk (the last row's logits), or a chain verify (every row's logits, the
// GDN tape recorded, pending until commit_slot). Each at the slot's own positions n_past...
enum batch_kind { BATCH_PREFILL, BATCH_DECODE, BATCH_VERIFY };
struct batch_item {
    int slot = 0;
    std::vector<int32_t> tokens;
    batch_kind kind = BATCH_DECODE;
    // A tree verify (BATCH_VERIFY): node i's parent (parents[0] = -1, parents[i] < i), as
    // verify_tree takes them; empty: a chain.
    std::vector<int32_t> parents;
};

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

    // decode() of the tokens, then the next token chosen by choose_token (sampler.h: drawn by the
    // sampler, or the argmax at temperature 0) from the last row's logits at its position (n_past
    // after the tokens): the sampled AR step, and the AR step that reports logprobs (into lp).
    // With a constraint (constraint.h): the choice under its mask, which then accepts the token.
    int32_t decode_sampled(const int32_t * tokens, int64_t n, const sampling_params & p, token_logprobs * lp = nullptr,
                           token_constraint * constraint = nullptr);

    // Verify pass: like decode() with all logits, but GDN layers record their tape instead of
    // updating their state. Must be followed by commit(n_keep) before the next decode or verify.
    // argmax_only: return the greedy token per row instead of the logits (computed in the graph).
    decode_result verify(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers = {},
                         bool argmax_only = false);

    // Tree verify: tokens[i] is node i of a tree (parents[0] == -1, parents[i] < i), at position
    // n_past + depth(i), in one graph: attention sees the committed rows and the node's ancestors
    // (gathered: attn.h), GDN layers run and record each node from its parent's state (gdn_tape.h),
    // the conv over its ancestors (conv.h). Returns the argmax per node (and the taps per node).
    // At most max_verify nodes; host caches and tape rollback only. Must be followed by
    // commit_tree(path). argmax_only false: the logits per node instead (sampled trees, logprobs).
    decode_result verify_tree(const int32_t * tokens, const int32_t * parents, int64_t n,
                              const std::vector<int> & tap_layers = {}, bool argmax_only = true);
    // Keep the accepted path of the pending tree verify (node indices, root first: path[0] == 0,
    // each the previous one's child): its K/V rows and tape slots are compacted into rows
    // n_past_before + d and slots d (in order, so no row is read after it was overwritten),
    // then commit(path.size()) as for a chain.
    void commit_tree(const std::vector<int32_t> & path);

    // Keep the first n_keep (1..n) tokens of the pending verify: attention K/V cursor to
    // n_past_before + n_keep; GDN state replayed from the tape; conv state from the tape inputs.
    void commit(int64_t n_keep);

    void reset() { reset_slot(cur_); }
    int64_t n_past() const { return cache_->n_past; }

    // ---- several sequences: session_params::n_seq slots (docs/architecture.md, "Batched target") ----
    // One target pass over the items' tokens (distinct slots, at most n_batch tokens in all): every
    // weight is read once for all of them; attention, the GDN conv and recurrence run per item over
    // its slot's cache. Each item's logits (rows as its kind says), taps and caches are those of
    // the same work run alone on that slot, bit for bit (the matmul contract: at most
    // k_matmul_max_cols tokens in all, or weights the wide GEMM takes). Returns one result per item;
    // argmax_only: the greedy token of each of its rows (in the graph) instead of the logits.
    std::vector<decode_result> decode_batch(const std::vector<batch_item> & items, const std::vector<int> & tap_layers = {},
                                            bool argmax_only = false);
    // The most tokens one decode_batch pass may hold with that contract: n_batch where every weight
    // matmul is this package's kernel (the CPU, matmul "own": each column computes alone at any
    // width); else k_matmul_max_cols (ggml's kernels, or a device's, choose by width).
    int64_t batch_width() const;
    // The slot the one-sequence methods above (decode, verify, commit, n_past, reset, cache) serve
    // from now on; slot 0 until changed. A spec_session bound to a slot selects it before each use.
    void select_slot(int slot);
    int selected_slot() const { return cur_; }
    // commit() of slot `slot`'s pending verify.
    void commit_slot(int slot, int64_t n_keep);
    void reset_slot(int slot);
    int n_seq() const { return (int) slots_.size(); }
    int64_t slot_n_past(int slot) const { return slots_.at(check_slot(slot)).cache->n_past; }
    // A slot's cache for inspection (its deferred replay done first), as cache() is slot 0's.
    model_cache & slot_cache(int slot) {
        model_cache & c = *slots_.at(check_slot(slot)).cache;
        flush_replay(c);
        return c;
    }

    const target_hparams & hparams() const { return model_->hparams(); }
    const target_model & model() const { return *model_; }
    // The cache as it stands, for inspection: a replay commit() deferred is done first.
    model_cache & cache() { return slot_cache(cur_); }
    const session_params & params() const { return params_; }
    size_t n_graph_plans() const { return runner_->n_plans(); }
    // The target's part of memory_usage: its weights, caches and compute buffers.
    memory_usage memory() const;
    // One sequence slot's caches (kv_cache, gdn_state, gdn_tape; the rest 0).
    memory_usage slot_memory(int slot) const;

    // The backends, plans and metadata arena this session's graphs run on; the drafter runs its
    // graphs on the same runner (it shares the target's embeddings, lm_head and buffers).
    graph_runner & runner() { return *runner_; }
    // The next decode or verify with taps writes them into `dst` (F32 [n_taps * n_embd, cols], a
    // device tensor) at columns col0.. instead of copying them to the host (decode_result::taps
    // stays empty): the spec session's device feature queue. One call only; cleared by it.
    void set_tap_sink(ggml_tensor * dst, int64_t col0) { sink_ = {dst, col0}; }
    // A slot's device feature queue (its spec_session's, F32 [n_taps * n_embd, cols]): a batched
    // pass (decode_batch) with taps writes that slot's taps there, at the first of its n tokens'
    // columns that reserve(n) gives (which may push the queue into the ring first), instead of
    // copying them to the host (that item's decode_result::taps stays empty). The first queue
    // registered for a slot serves it until cleared by the same dst.
    struct tap_queue {
        ggml_tensor * dst = nullptr;
        std::function<int64_t(int64_t)> reserve;
    };
    void set_slot_tap_queue(int slot, tap_queue q);
    void clear_slot_tap_queue(int slot, const ggml_tensor * dst);
    ggml_backend_buffer_type_t buffer_type() const { return runner_->buffer_type(); }

    // A tree's positions: text_pos[i] = n_past + depth(i) (parents[i] < i, parents[0] = -1): where
    // a tree verify runs node i, and (n_past 0) the depths its acceptance reads.
    static void tree_positions(int64_t n_past, int64_t n, const int32_t * parents, int64_t * text_pos);

private:
    void replay_state(const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep);
    // commit() on a device: one graph replays the kept prefix into each GDN state and conv state
    // (of a slot's cache: each slot's states and tape live in device buffers of their own)
    void commit_on_device(const model_cache & cache, int64_t n_keep, int64_t n_verified);
    // n_seq > 1 on a device: a MemoryError unless each device can hold the other slots' caches
    static void require_device_room(const model_cache & first, int n_seq, const std::string & what);
    // one sequence slot: its cache and its pending verify
    struct seq_slot {
        std::unique_ptr<model_cache> cache;
        int64_t pending_n = 0;       // tokens of an uncommitted verify
        int64_t pending_past = 0;    // n_past before it
        std::vector<int32_t> pending_tokens;   // its tokens (re-decode rollback)
        std::vector<int32_t> pending_parents;  // a pending tree verify's parents (empty: a chain)
        tap_queue queue;                       // where a batched pass writes its taps (set_slot_tap_queue)
    };
    int check_slot(int slot) const;
    void flush_replay(model_cache & c);  // the replay commit() left to the next graph, done now on the host
    void check_tokens(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers) const {
        check_slot_tokens(slots_[cur_], tokens, n, tap_layers);
    }
    void check_slot_tokens(const seq_slot & s, const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers) const;
    // the causal mask of n tokens after n_past over n_kv rows: F16 [n_kv, n] (0 or -inf)
    static void fill_causal_mask(int64_t n_past, int64_t n, int64_t n_kv, ggml_fp16_t * mask);
    // a tree's: node i sees the n_past committed rows and its ancestors and itself among the n
    // rows after them; text_pos[i] = n_past + depth(i)
    static void fill_tree_mask(int64_t n_past, int64_t n, int64_t n_kv, const int32_t * parents, ggml_fp16_t * mask);
    // a tree verify of n nodes: its parents, the verify capacity and a rollback that takes trees
    void check_tree(const int32_t * parents, int64_t n) const;
    // the tree's parents where its GDN ops read them, with the replay the pass folds in
    static void arm_tree(model_cache & c, const int32_t * parents, int64_t n);
    // verify's and verify_tree's pass (parents: the tree's, or nullptr for a chain), left pending
    decode_result run_verify(const int32_t * tokens, const int32_t * parents, int64_t n,
                             const std::vector<int> & tap_layers, bool argmax_only);
    void run_chunk(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers,
                   decode_result & out, int64_t tok_offset, int64_t n_total, bool record_tape, bool argmax_only,
                   const int32_t * tree_parents = nullptr);
    // One forward graph of run_chunk: the target's inputs and which outputs it gives.
    struct chunk_graph {
        graph_inputs g;
        bool all_logits = false;   // every row (else the last)
        bool want_logits = false;  // logits at all (a prompt chunk before the last: only the caches)
        bool argmax_only = false;  // the greedy token per row instead of the logits
        ggml_tensor * logits = nullptr;  // F32 [n_vocab, rows]
        ggml_tensor * argmax = nullptr;  // I32 [rows], when argmax_only
        device_head head;                // on a device: the argmax in stock ops (device_heads.h)
        ggml_tensor * sink = nullptr;    // the taps' destination (set_tap_sink), at column sink_col0
        int64_t sink_col0 = 0;
        const int32_t * parents = nullptr;  // tree verify: the nodes' parents [n] (graph.h)
    };
    // tree verify's inputs: positions n_past + depth, the ancestor mask, the parents
    void set_tree_inputs(const chunk_graph & c) const;
    void compact_rows(ggml_tensor * t, size_t row_bytes, size_t stride, int64_t row0, const std::vector<int32_t> & path);
    void build_chunk(const build_context & b, chunk_graph & c) const;
    void set_chunk_inputs(const chunk_graph & c, const int32_t * tokens) const;
    // logits or argmax rows and taps into out at token tok_offset; throws on non-finite logits
    void read_chunk(const chunk_graph & c, decode_result & out, int64_t tok_offset) const;

    // Declaration order is destruction order reversed: the buffers (cache, weights) go before
    // the runner's backends they live on.
    session_params params_;
    std::unique_ptr<graph_runner> runner_;
    std::unique_ptr<target_model> model_;
    std::vector<seq_slot> slots_;  // n_seq; slot cur_ serves decode / verify / commit
    int cur_ = 0;                    // select_slot
    model_cache * cache_ = nullptr;  // slot cur_'s cache
    std::unique_ptr<gdn_rollback> rollback_;  // chosen at construction (params_.rollback)
    struct tap_sink {
        ggml_tensor * dst = nullptr;
        int64_t col0 = 0;
    } sink_;
    struct sink_reset {
        tap_sink & s;
        ~sink_reset() { s = {}; }
    };
};

}  // namespace dfn
