#include "runtime/session.h"

#include "base/alloc.h"
#include "base/common.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/gdn_tape.h"
#include "graph/graph.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/matmul/dispatch.h"
#include "base/profile.h"
#include "kernels/cpu/top1.h"
#include "spec/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace dfn {

static const char * W = "decode";

target_session::target_session(const std::string & path, const session_params & params) : params_(params) {
    install_ggml_log();
    isa_check();  // a bad DFLASH_NATIVE_ISA raises here, before any kernel runs
    // positions are int32 in the graphs; a larger n_ctx would also overflow the cache tensors' element
    // counts (a GGML_ASSERT in ggml_new_tensor) before any allocation could fail cleanly
    DFN_REQUIRE(params.n_ctx >= 1, "engine", "n_ctx must be >= 1, got ", params.n_ctx);
    DFN_REQUIRE(params.n_ctx <= INT32_MAX, "engine", "n_ctx must be <= ", INT32_MAX, " (positions are int32), got ",
                params.n_ctx);
    DFN_REQUIRE(params.n_batch >= 1, "engine", "n_batch must be >= 1, got ", params.n_batch);
    DFN_REQUIRE(params.n_threads >= 0 && params.n_threads <= GGML_MAX_N_THREADS, "engine",
                "n_threads must be in [1, ", GGML_MAX_N_THREADS, "] (or 0: all cores), got ", params.n_threads);
    DFN_REQUIRE(params.kv_type == GGML_TYPE_F16 || params.kv_type == GGML_TYPE_F32, "engine",
                "kv_type must be f16 or f32");
    DFN_REQUIRE(params.max_verify >= 0 && params.max_verify <= k_max_block_size, "engine",
                "block_size (max_verify) must be in [0, ", k_max_block_size,
                "], the most tokens one round may verify; got ", params.max_verify);
    // a verify pass is one graph: n_batch covers the block whatever the prompt chunk size
    params_.n_batch = std::max(params.n_batch, params.max_verify);

    model_ = target_model::open(path);
    const int n_threads = params.n_threads > 0 ? params.n_threads : (int) std::max(1u, std::thread::hardware_concurrency());
    params_.n_threads = n_threads;
    DFN_REQUIRE(params.n_seq >= 1, "engine", "n_seq must be >= 1, got ", params.n_seq);
    DFN_REQUIRE(params.n_seq == 1 || params.rollback == ROLLBACK_TAPE, "engine",
                "n_seq > 1 (several sequence slots) runs with tape rollback only");
    // a batch adds, per layer and sequence, its views, K/V writes, the tape's copies and the joins of
    // the outputs: measured on the tiny test models, under 20 nodes a layer on the CPU, up to 34 a GDN
    // layer and 20 an attention layer on a device (its stock ops). A pass holds at most n_batch sequences.
    const int64_t max_segs = std::min<int64_t>(params.n_seq, params_.n_batch);
    const size_t max_nodes = std::max<size_t>(2048, (size_t) model_->hparams().n_layer * (96 + 64 * (max_segs - 1)) + 256);
    runner_ = std::make_unique<graph_runner>(params.device, n_threads, params.matmul, max_nodes);

    // by layer over the devices of a split (graph_runner::target_buffer_type); one device or the CPU:
    // one buffer type, so the file is mapped where it can be (gguf_file::load_weights)
    const int n_layer = model_->hparams().n_layer;
    model_->load_weights([&](const ggml_tensor * t) { return runner_->target_buffer_type(t->name, n_layer); },
                         params.use_mmap);
    tune_matmul(*runner_, model_->file().tensors());  // each weight type's matmul level (dispatch.h)
    rollback_ = make_gdn_rollback(params.rollback);
    auto new_cache = [&] {
        return std::make_unique<model_cache>(model_->hparams(), params.n_ctx, params.kv_type, params.max_verify,
                                             rollback_->keeps_snapshots(), runner_->on_device(),
                                             [&](int il) { return runner_->layer_buffer_type(il, n_layer); });
    };
    slots_.resize(params.n_seq);
    slots_[0].cache = new_cache();
    if (params.n_seq > 1) {
        // all slots' caches must fit before any is made: they are zeroed (touched) when made
        const size_t per_slot = slots_[0].cache->bytes(), rest = per_slot * (size_t) (params.n_seq - 1);
        const std::string what = cat("the caches of n_seq = ", params.n_seq, " sequence slots (", format_bytes(per_slot),
                                     " each at n_ctx = ", params.n_ctx, ")");
        if (runner_->on_device()) {
            require_device_room(*slots_[0].cache, params.n_seq, what);
        } else {
            const size_t phys = physical_memory_bytes();
            if (phys > 0 && per_slot * (size_t) params.n_seq > phys) {
                throw memory_error(cat("[engine] out of memory: ", what, " need ", format_bytes(per_slot * params.n_seq),
                                       ", more than this machine's ", format_bytes(phys), "; lower n_seq or n_ctx"));
            }
            require_headroom(rest, "engine", what);
        }
        for (int i = 1; i < params.n_seq; ++i) slots_[i].cache = new_cache();
    }
    cache_ = slots_[0].cache.get();
}

void target_session::require_device_room(const model_cache & first, int n_seq, const std::string & what) {
    // each device (several: a model split by layers) holds its layers' caches of every slot: the
    // other slots' beside the first's, which is allocated already
    for (const ggml_backend_buffer_ptr & b : first.buffers()) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(b.get()));
        size_t free = 0, total = 0;
        if (dev) ggml_backend_dev_memory(dev, &free, &total);
        const size_t size = ggml_backend_buffer_get_size(b.get()), need = size * (size_t) (n_seq - 1);
        if (free > 0 && need > free) {
            throw memory_error(cat("[engine] out of memory: ", what, " need ", format_bytes(size * (size_t) n_seq), " on device ",
                                   ggml_backend_dev_name(dev), ", whose ", format_bytes(free),
                                   " free memory cannot hold the other slots' ", format_bytes(need),
                                   "; lower n_seq or n_ctx"));
        }
    }
}

int target_session::check_slot(int slot) const {
    DFN_REQUIRE(slot >= 0 && slot < (int) slots_.size(), "batch", "sequence slot ", slot, " outside [0, ", slots_.size(),
                ") (n_seq = ", slots_.size(), ")");
    return slot;
}

void target_session::set_slot_tap_queue(int slot, tap_queue q) {
    seq_slot & s = slots_.at(check_slot(slot));
    if (!s.queue.dst) s.queue = std::move(q);
}

void target_session::clear_slot_tap_queue(int slot, const ggml_tensor * dst) {
    seq_slot & s = slots_.at(check_slot(slot));
    if (s.queue.dst == dst) s.queue = {};
}

void target_session::reset_slot(int slot) {
    seq_slot & s = slots_.at(check_slot(slot));
    s.cache->clear();
    s.pending_n = 0;
    s.pending_parents.clear();
}

target_session::~target_session() = default;

memory_usage target_session::slot_memory(int slot) const {
    const model_cache & c = *slots_.at(check_slot(slot)).cache;
    memory_usage m;
    m.kv_cache = c.kv_bytes();
    m.gdn_state = c.gdn_state_bytes();
    m.gdn_tape = c.gdn_tape_bytes();
    return m;
}

memory_usage target_session::memory() const {
    memory_usage m;
    m.target_weights_mapped = model_->file().mapped_bytes();
    m.target_weights_copied = model_->file().copied_bytes();
    for (const seq_slot & s : slots_) {  // every sequence slot's
        m.kv_cache += s.cache->kv_bytes();
        m.gdn_state += s.cache->gdn_state_bytes();
        m.gdn_tape += s.cache->gdn_tape_bytes();
    }
    m.compute_target = runner_->compute_bytes({"target:", "commit:"});
    return m;
}

void target_session::check_slot_tokens(const seq_slot & s, const int32_t * tokens, int64_t n,
                                       const std::vector<int> & tap_layers) const {
    const target_hparams & hp = model_->hparams();
    const model_cache & c = *s.cache;
    DFN_REQUIRE(s.pending_n == 0, W, "a verify of ", s.pending_n, " tokens is pending: commit() it first");
    DFN_REQUIRE(n > 0, W, "empty input: no tokens to decode");
    DFN_REQUIRE(c.n_past + n <= c.n_ctx, W, "context overflow: ", c.n_past, " cached + ", n, " new tokens > n_ctx = ",
                c.n_ctx);
    for (int64_t i = 0; i < n; ++i) {
        DFN_REQUIRE(tokens[i] >= 0 && tokens[i] < hp.n_vocab, W, "token id ", tokens[i], " at index ", i,
                    " is outside the vocabulary [0, ", hp.n_vocab, ")");
    }
    for (int il : tap_layers) {
        DFN_REQUIRE(il >= 0 && il < hp.n_layer, W, "tap layer ", il, " outside [0, ", hp.n_layer, ")");
    }
}

decode_result target_session::decode(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers,
                                     bool argmax_only) {
    const sink_reset once{sink_};  // the tap sink (set_tap_sink) serves this call only, whatever happens
    const target_hparams & hp = model_->hparams();
    check_tokens(tokens, n, tap_layers);

    decode_result out;
    out.n_rows = all_logits ? n : 1;
    if (argmax_only) out.argmax.resize(out.n_rows);
    else out.logits.resize((size_t) out.n_rows * hp.n_vocab);
    if (!tap_layers.empty() && !sink_.dst) out.taps.resize((size_t) n * tap_layers.size() * hp.n_embd);

    const int64_t n_past0 = cache_->n_past;
    try {
        for (int64_t off = 0; off < n; off += params_.n_batch) {
            const int64_t m = std::min(params_.n_batch, n - off);
            run_chunk(tokens + off, m, all_logits, tap_layers, out, off, n, false, argmax_only);
        }
    } catch (...) {
        // K/V rows past the old cursor are dead; GDN state cannot be restored here, so the caller
        // (Engine) must reset before the next request.
        cache_->n_past = n_past0;
        throw;
    }
    return out;
}

int32_t target_session::decode_sampled(const int32_t * tokens, int64_t n, const sampling_params & p,
                                       token_logprobs * lp, token_constraint * constraint) {
    check_sampling_params(p);
    const decode_result r = decode(tokens, n, false);
    const logits_row row{r.logits.data(), model_->hparams().n_vocab};
    return choose_next(constraint, row, p, cache_->n_past, W, lp);
}

decode_result target_session::verify(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers,
                                     bool argmax_only) {
    const sink_reset once{sink_};  // the tap sink (set_tap_sink) serves this call only, whatever happens
    const target_hparams & hp = model_->hparams();
    check_tokens(tokens, n, tap_layers);
    DFN_REQUIRE(n <= cache_->n_tape || hp.is_gdn.empty(), "verify", n, " tokens > max_verify = ", cache_->n_tape,
                " (the GDN tape capacity this engine was created with)");
    DFN_REQUIRE(n <= params_.n_batch, "verify", n, " tokens > n_batch = ", params_.n_batch);

    return run_verify(tokens, nullptr, n, tap_layers, argmax_only);
}

decode_result target_session::run_verify(const int32_t * tokens, const int32_t * parents, int64_t n,
                                         const std::vector<int> & tap_layers, bool argmax_only) {
    const target_hparams & hp = model_->hparams();
    decode_result out;
    out.n_rows = n;
    if (argmax_only) out.argmax.resize(n);
    else out.logits.resize((size_t) n * hp.n_vocab);
    if (!tap_layers.empty() && !sink_.dst) out.taps.resize((size_t) n * tap_layers.size() * hp.n_embd);
    const int64_t n_past0 = cache_->n_past;
    try {
        run_chunk(tokens, n, true, tap_layers, out, 0, n, true, argmax_only, parents);
    } catch (...) {
        cache_->n_past = n_past0;  // GDN state was not touched by a verify pass
        throw;
    }
    slots_[cur_].pending_past = n_past0;
    slots_[cur_].pending_n = n;
    slots_[cur_].pending_tokens.assign(tokens, tokens + n);
    return out;
}

void target_session::check_tree(const int32_t * parents, int64_t n) const {
    check_tree_parents(parents, n, "verify");
    DFN_REQUIRE(n <= std::max<int64_t>(params_.max_verify, 1), "verify", "a tree of ", n, " nodes > max_verify = ",
                params_.max_verify, " (the verify capacity this engine was created with)");
    DFN_REQUIRE(rollback_->supports_tree() || model_->hparams().is_gdn.empty(), "verify", "tree verify needs tape rollback");
}

void target_session::arm_tree(model_cache & c, const int32_t * parents, int64_t n) {
    c.tree.parents.assign(parents, parents + n);  // the GDN ops' (gdn_tape.h: gdn_tree_pass)
    c.tree.replay_n = c.replay_n;
}

decode_result target_session::verify_tree(const int32_t * tokens, const int32_t * parents, int64_t n,
                                          const std::vector<int> & tap_layers, bool argmax_only) {
    const sink_reset once{sink_};  // the tap sink (set_tap_sink) serves this call only, whatever happens
    check_tokens(tokens, n, tap_layers);
    check_tree(parents, n);
    DFN_REQUIRE(n <= params_.n_batch, "verify", n, " nodes > n_batch = ", params_.n_batch);
    arm_tree(*cache_, parents, n);
    decode_result out = run_verify(tokens, parents, n, tap_layers, argmax_only);
    slots_[cur_].pending_parents.assign(parents, parents + n);
    return out;
}

void target_session::compact_rows(ggml_tensor * t, size_t row_bytes, size_t stride, int64_t row0,
                                  const std::vector<int32_t> & path) {
    const bool host = ggml_backend_buffer_is_host(t->buffer);
    std::vector<uint8_t> tmp(host ? 0 : row_bytes);
    // path[d] >= d and increasing: row0 + path[d'] for d' > d is never a row written before it
    for (size_t d = 1; d < path.size(); ++d) {
        if (path[d] == (int32_t) d) continue;
        const size_t src = (row0 + path[d]) * stride, dst = (row0 + d) * stride;
        if (host) {
            std::memcpy((char *) t->data + dst, (const char *) t->data + src, row_bytes);
        } else {
            ggml_backend_tensor_get(t, tmp.data(), src, row_bytes);
            ggml_backend_tensor_set(t, tmp.data(), dst, row_bytes);
        }
    }
}

void target_session::commit_tree(const std::vector<int32_t> & path) {
    DFN_REQUIRE(slots_[cur_].pending_n > 0 && !slots_[cur_].pending_parents.empty(), "commit", "no tree verify is pending");
    DFN_REQUIRE(!path.empty() && path[0] == 0, "commit", "the accepted path must start at the root (node 0)");
    for (size_t d = 1; d < path.size(); ++d) {
        DFN_REQUIRE(path[d] > 0 && path[d] < slots_[cur_].pending_n && slots_[cur_].pending_parents[path[d]] == path[d - 1], "commit",
                    "path[", d, "] = ", path[d], " is not a child of path[", d - 1, "] = ", path[d - 1]);
    }
    const target_hparams & hp = model_->hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        if (!hp.is_gdn.empty() && hp.is_gdn[il]) {
            const gdn_layer & L = cache_->gdn[il];
            // tape slots of the path, in path order: what commit() replays and reads the conv from
            compact_rows(L.tape_k, L.tape_k->nb[2], L.tape_k->nb[2], 0, path);
            compact_rows(L.tape_u, L.tape_u->nb[2], L.tape_u->nb[2], 0, path);
            compact_rows(L.tape_g, L.tape_g->nb[1], L.tape_g->nb[1], 0, path);
            compact_rows(L.tape_qkv, L.tape_qkv->nb[1], L.tape_qkv->nb[1], 0, path);
        } else {
            const kv_layer & L = cache_->kv[il];
            compact_rows(L.k, L.k->nb[2], L.k->nb[2], slots_[cur_].pending_past, path);
            compact_rows(L.v, L.v->nb[2], L.v->nb[2], slots_[cur_].pending_past, path);
        }
    }
    for (size_t d = 0; d < path.size(); ++d) slots_[cur_].pending_tokens[d] = slots_[cur_].pending_tokens[path[d]];
    slots_[cur_].pending_parents.clear();
    commit((int64_t) path.size());
}

int32_t greedy_of(const decode_result & v, int64_t i, int64_t n_vocab, int64_t pos, const char * where) {
    if (!v.argmax.empty()) return v.argmax[i];
    return choose_token(logits_row{v.logits.data() + (size_t) i * n_vocab, n_vocab}, sampling_params{}, pos, where);
}

void target_session::replay_state(const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep) {
    // host memory only (a device replays in its commit graph: commit_on_device)
    gdn_tape_replay_mt((float *) L.ssm->data, {(float *) L.tape_k->data, (float *) L.tape_u->data,
                       (float *) L.tape_g->data}, S, H_v, n_keep, params_.n_threads);
}

void target_session::commit(int64_t n_keep) { commit_slot(cur_, n_keep); }

int64_t target_session::batch_width() const {
    const bool own = params_.matmul == MATMUL_OWN && !runner_->on_device();
    return own ? params_.n_batch : std::min(params_.n_batch, k_matmul_max_cols);
}

void target_session::select_slot(int slot) {
    cur_ = check_slot(slot);
    cache_ = slots_[cur_].cache.get();
}

void target_session::commit_slot(int slot, int64_t n_keep) {
    seq_slot & s = slots_.at(check_slot(slot));
    model_cache & cache = *s.cache;
    DFN_REQUIRE(s.pending_n > 0, "commit", "no verify is pending");
    DFN_REQUIRE(n_keep >= 1 && n_keep <= s.pending_n, "commit", "n_keep = ", n_keep, " outside [1, ", s.pending_n, "]");
    profile_scope timer("target", ":commit");
    s.pending_parents.clear();
    const target_hparams & hp = model_->hparams();
    cache.n_past = s.pending_past + n_keep;  // attention: dead rows past the cursor are overwritten later
    const int64_t n_verified = s.pending_n;
    s.pending_n = 0;
    if (hp.is_gdn.empty()) return;
    if (rollback_->redecodes()) {
        // the GDN state is still the one before the verify: run the kept tokens again
        cache.n_past = s.pending_past;
        decode(s.pending_tokens.data(), n_keep, false);
        return;
    }

    if (runner_->on_device()) {
        commit_on_device(cache, n_keep, n_verified);
        return;
    }
    const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads, n_ch = hp.ssm_conv_channels();
    const int64_t kc = hp.ssm_d_conv - 1;
    bool defer = false;
    for (int il = 0; il < hp.n_layer; ++il) {
        if (!hp.is_gdn[il]) continue;
        gdn_layer & L = cache.gdn[il];
        defer = rollback_->restore_host(L, n_keep, n_verified) || defer;  // deferred: cache.h, replay_n

        // conv state: the last kc inputs of [old state (kc columns); the n_keep kept inputs]
        std::vector<float> conv((size_t) kc * n_ch), qkv((size_t) n_ch * n_keep);
        ggml_backend_tensor_get(L.conv, conv.data(), 0, conv.size() * sizeof(float));
        ggml_backend_tensor_get(L.tape_qkv, qkv.data(), 0, qkv.size() * sizeof(float));
        std::vector<float> out((size_t) kc * n_ch);
        for (int64_t c = 0; c < n_ch; ++c) {
            for (int64_t j = 0; j < kc; ++j) {
                const int64_t src = n_keep + j;  // index into the kc + n_keep long sequence, from its end
                out[c * kc + j] = src < kc ? conv[c * kc + src] : qkv[(src - kc) * n_ch + c];
            }
        }
        ggml_backend_tensor_set(L.conv, out.data(), 0, out.size() * sizeof(float));
    }
    if (defer) cache.replay_n = n_keep;
}

void target_session::commit_on_device(const model_cache & cache, int64_t n_keep, int64_t n_verified) {
    // One graph on the device: per GDN layer, the state the rollback strategy restores (rollback.h:
    // the tape's kept prefix replayed through the same ggml_gated_delta_net the AR step runs), and
    // the conv state from the kept conv inputs. Nothing crosses the bus.
    const target_hparams & hp = model_->hparams();
    const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads, n_ch = hp.ssm_conv_channels();
    const int64_t kc = hp.ssm_d_conv - 1;
    const size_t es = sizeof(float);
    auto build = [&](const build_context & b) {
        ggml_context * ctx = b.ctx;
        for (int il = 0; il < hp.n_layer; ++il) {
            if (!hp.is_gdn[il]) continue;
            const gdn_layer & L = cache.gdn[il];
            rollback_->restore_device(b, L, S, H_v, n_keep, n_verified);
            // conv state: the last kc columns of [old state (kc columns); the n_keep kept inputs]
            ggml_tensor * qkv = ggml_view_2d(ctx, L.tape_qkv, n_ch, n_keep, L.tape_qkv->nb[1], 0);  // [n_ch, n_keep]
            ggml_tensor * conv_in = ggml_concat(ctx, L.conv, ggml_cont(ctx, ggml_transpose(ctx, qkv)), 0);  // [kc + n_keep, n_ch]
            ggml_tensor * last = ggml_view_2d(ctx, conv_in, kc, n_ch, conv_in->nb[1], n_keep * es);
            ggml_build_forward_expand(b.gf, ggml_cpy(ctx, last, L.conv));
        }
    };
    // the plan depends on n_keep alone (the snapshot's slot is a view offset into the cache)
    runner_->run(cat("commit:", n_keep, ":", rollback_->name()), build, [] {}, [] {});
}

void target_session::flush_replay(model_cache & c) {
    if (c.replay_n == 0) return;
    const target_hparams & hp = model_->hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        if (hp.is_gdn[il]) replay_state(c.gdn[il], hp.ssm_head_dim, hp.ssm_n_v_heads, c.replay_n);
    }
    c.replay_n = 0;
}

// Columns c0..c0 + n of the taps (each F32 [n_embd, cols]) into a device feature queue dst (F32
// [n_taps * n_embd, cols]) at columns col0..: tap t to rows [t * n_embd, (t + 1) * n_embd).
static void sink_tap_columns(const build_context & b, const std::vector<ggml_tensor *> & taps, int64_t c0, int64_t n,
                             ggml_tensor * dst, int64_t col0) {
    for (size_t t = 0; t < taps.size(); ++t) {
        const int64_t ne = taps[t]->ne[0];
        ggml_tensor * view = ggml_view_2d(b.ctx, dst, ne, n, dst->nb[1], col0 * dst->nb[1] + t * ne * sizeof(float));
        ggml_build_forward_expand(b.gf, ggml_cpy(b.ctx, columns_view(b, taps[t], 1, c0, n), view));
    }
}

void target_session::build_chunk(const build_context & b, chunk_graph & c) const {
    graph_inputs & g = c.g;
    static_cast<build_context &>(g) = b;
    ggml_context * ctx = b.ctx;
    const int64_t n = g.n_tokens;
    g.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n * model_->n_pos_per_token());
    g.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g.n_kv, n);
    ggml_set_input(g.tokens);
    ggml_set_input(g.pos);
    ggml_set_input(g.kq_mask);
    if (c.parents) {
        g.tree_parents = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(g.tree_parents);
    }

    ggml_tensor * hidden = model_->build_forward(g);  // [n_embd, n]
    if (c.sink) sink_tap_columns(b, g.taps, 0, n, c.sink, c.sink_col0);
    if (!c.want_logits) {
        ggml_build_forward_expand(g.gf, hidden);
        return;
    }
    if (!c.all_logits) hidden = ggml_view_2d(ctx, hidden, hidden->ne[0], 1, hidden->nb[1], (n - 1) * hidden->nb[1]);
    c.logits = matmul(g, model_->output, hidden);  // [n_vocab, rows]
    ggml_tensor * res = c.logits;
    if (c.argmax_only && b.device) {
        c.head = device_argmax(b, c.logits, /*with_p=*/false);
        c.argmax = c.head.ids;
        return;
    }
    // our argmax op under every CPU matmul setting: it flags non-finite rows (ggml_argmax cannot)
    if (c.argmax_only) res = c.argmax = argmax_op(ctx, c.logits);  // I32 [rows]
    ggml_set_output(res);
    ggml_build_forward_expand(g.gf, res);
}

void target_session::tree_positions(int64_t n_past, int64_t n, const int32_t * parents, int64_t * text_pos) {
    std::vector<int64_t> depth(n, 0);
    for (int64_t i = 1; i < n; ++i) depth[i] = depth[parents[i]] + 1;
    for (int64_t i = 0; i < n; ++i) text_pos[i] = n_past + depth[i];
}

void target_session::fill_tree_mask(int64_t n_past, int64_t n, int64_t n_kv, const int32_t * parents, ggml_fp16_t * mask) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    std::fill(mask, mask + (size_t) n_kv * n, ninf);
    for (int64_t i = 0; i < n; ++i) {
        ggml_fp16_t * row = mask + (size_t) i * n_kv;
        for (int64_t j = 0; j < n_past; ++j) row[j] = zero;
        for (int64_t a = i; a >= 0; a = parents[a]) row[n_past + a] = zero;
    }
}

void target_session::set_tree_inputs(const chunk_graph & c) const {
    const graph_inputs & g = c.g;
    const int64_t n = g.n_tokens;
    std::vector<int64_t> text_pos(n);
    tree_positions(g.n_past, n, c.parents, text_pos.data());
    std::vector<int32_t> pos(n * model_->n_pos_per_token());
    model_->fill_positions_at(text_pos.data(), n, pos.data());
    if (g.pos->buffer) ggml_backend_tensor_set(g.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
    // each node sees the committed rows and its ancestors (and itself) among the tree's rows
    std::vector<ggml_fp16_t> mask((size_t) g.n_kv * n);
    fill_tree_mask(g.n_past, n, g.n_kv, c.parents, mask.data());
    if (g.kq_mask->buffer) ggml_backend_tensor_set(g.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
    if (g.tree_parents->buffer) ggml_backend_tensor_set(g.tree_parents, c.parents, 0, n * sizeof(int32_t));
}

void target_session::set_chunk_inputs(const chunk_graph & c, const int32_t * tokens) const {
    const graph_inputs & g = c.g;
    const int64_t n = g.n_tokens;
    ggml_backend_tensor_set(g.tokens, tokens, 0, n * sizeof(int32_t));
    if (c.parents) {
        set_tree_inputs(c);
        return;
    }
    std::vector<int32_t> pos(n * model_->n_pos_per_token());
    model_->fill_positions(g.n_past, n, pos.data());
    // Positions and mask feed attention layers only: in a model without any (all GDN) no node
    // reads them, the scheduler gives them no buffer, and there is nothing to set.
    if (g.pos->buffer) ggml_backend_tensor_set(g.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
    std::vector<ggml_fp16_t> mask((size_t) g.n_kv * n);
    fill_causal_mask(g.n_past, n, g.n_kv, mask.data());
    if (g.kq_mask->buffer) ggml_backend_tensor_set(g.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
}

void target_session::fill_causal_mask(int64_t n_past, int64_t n, int64_t n_kv, ggml_fp16_t * mask) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = n_past + i;
        ggml_fp16_t * row = mask + (size_t) i * n_kv;
        for (int64_t j = 0; j < n_kv; ++j) row[j] = j <= p ? zero : ninf;
    }
}

void target_session::read_chunk(const chunk_graph & c, decode_result & out, int64_t tok_offset) const {
    const target_hparams & hp = model_->hparams();
    const graph_inputs & g = c.g;
    const int64_t n = g.n_tokens;
    const char * where = g.record_tape ? "verify" : W;
    // position of logits row r: the rows are the chunk's tokens, or its last token only
    const int64_t row_pos0 = c.all_logits ? g.n_past : g.n_past + n - 1;
    if (c.argmax) {
        int32_t * dst = out.argmax.data() + (c.all_logits ? tok_offset : 0);
        if (c.head.ids) {
            const int64_t bad = read_device_head(c.head, dst, nullptr);
            if (bad >= 0) throw_non_finite_logits(where, row_pos0 + bad);
        } else {
            ggml_backend_tensor_get(c.argmax, dst, 0, ggml_nelements(c.argmax) * sizeof(int32_t));
        }
        for (int64_t r = 0; r < ggml_nelements(c.argmax); ++r) {
            if (dst[r] < 0) throw_non_finite_logits(where, row_pos0 + r);  // top1.h
        }
    } else if (c.want_logits) {
        const int64_t rows = c.all_logits ? n : 1;
        float * dst = out.logits.data() + (c.all_logits ? (size_t) tok_offset * hp.n_vocab : 0);
        ggml_backend_tensor_get(c.logits, dst, 0, (size_t) rows * hp.n_vocab * sizeof(float));
        for (int64_t i = 0; i < rows * hp.n_vocab; ++i) {
            if (!std::isfinite(dst[i])) throw_non_finite_logits(where, row_pos0 + i / hp.n_vocab);
        }
    }
    const size_t n_taps = c.sink ? 0 : g.tap_layers.size();  // sunk taps stay on the device
    for (size_t t = 0; t < n_taps; ++t) {
        // taps[t]: [n_embd, n] -> out.taps[token][t][:]
        std::vector<float> buf((size_t) hp.n_embd * n);
        ggml_backend_tensor_get(g.taps[t], buf.data(), 0, buf.size() * sizeof(float));
        for (int64_t i = 0; i < n; ++i) {
            std::memcpy(out.taps.data() + (((size_t) (tok_offset + i)) * n_taps + t) * hp.n_embd,
                        buf.data() + (size_t) i * hp.n_embd, hp.n_embd * sizeof(float));
        }
    }
}

void target_session::run_chunk(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers,
                               decode_result & out, int64_t tok_offset, int64_t n_total, bool record_tape,
                               bool argmax_only, const int32_t * tree_parents) {
    chunk_graph c;
    c.parents = tree_parents;
    if (sink_.dst && !tap_layers.empty()) {
        DFN_REQUIRE(sink_.col0 + tok_offset + n <= sink_.dst->ne[1], "decode", "the tap sink holds ", sink_.dst->ne[1],
                    " columns, not ", sink_.col0 + tok_offset + n);
        c.sink = sink_.dst;
        c.sink_col0 = sink_.col0 + tok_offset;
    }
    c.all_logits = all_logits;
    c.want_logits = all_logits || tok_offset + n == n_total;  // the last chunk gives the last row
    c.argmax_only = argmax_only;
    graph_inputs & g = c.g;
    g.hp = &model_->hparams();
    g.cache = cache_;
    g.n_tokens = n;
    g.n_past = cache_->n_past;
    // the live prefix, padded (session.h; the mask hides the rest, and padded keys change no bits)
    g.n_kv = std::min(cache_->n_ctx, kv_padded(g.n_past + n));
    g.record_tape = record_tape;
    g.tap_layers = tap_layers;
    g.taps.assign(tap_layers.size(), nullptr);

    auto read_outputs = [&] {
        cache_->n_past += n;
        cache_->replay_n = 0;  // the GDN ops of this graph took the replay commit() deferred
        read_chunk(c, out, tok_offset);
    };
    std::string key = cat("target:", n, all_logits ? ":all" : ":last", c.want_logits ? ":logits" : ":hidden",
                          record_tape ? ":tape" : "", argmax_only ? ":argmax" : "", tree_parents ? ":tree" : "",
                          c.sink ? ":sink" : "", ":taps");
    for (int il : tap_layers) key += cat(",", il);
    runner_->run(
        key, [&](const build_context & b) { build_chunk(b, c); }, [&] { set_chunk_inputs(c, tokens); }, read_outputs);
}

std::vector<decode_result> target_session::decode_batch(const std::vector<batch_item> & items,
                                                       const std::vector<int> & tap_layers, bool argmax_only) {
    const target_hparams & hp = model_->hparams();
    DFN_REQUIRE(!items.empty(), "batch", "no work: the batch has no items");
    std::vector<char> seen(slots_.size(), 0);
    int64_t n_total = 0;
    for (const batch_item & it : items) {
        const seq_slot & s = slots_.at(check_slot(it.slot));
        DFN_REQUIRE(!seen[it.slot], "batch", "sequence slot ", it.slot, " appears twice in one batch");
        seen[it.slot] = 1;
        const int64_t n = (int64_t) it.tokens.size();
        check_slot_tokens(s, it.tokens.data(), n, tap_layers);
        DFN_REQUIRE(it.kind != BATCH_VERIFY || n <= s.cache->n_tape || hp.is_gdn.empty(), "verify", n,
                    " tokens > max_verify = ", s.cache->n_tape, " (the GDN tape capacity this engine was created with)");
        if (!it.parents.empty()) {  // a tree verify: what verify_tree checks
            DFN_REQUIRE(it.kind == BATCH_VERIFY && (int64_t) it.parents.size() == n, "batch",
                        "a tree item is a verify with one parent per node");
            check_tree(it.parents.data(), n);
        }
        n_total += n;
    }
    DFN_REQUIRE(n_total <= batch_width(), "batch", n_total, " tokens in one batch > ", batch_width(),
                " (batch_width(): n_batch = ", params_.n_batch, ")");

    // the segments (graph.h: graph_inputs::seq_segment) and the batch columns whose logits are read
    graph_inputs g;
    g.hp = &hp;
    g.n_tokens = n_total;
    g.tap_layers = tap_layers;
    g.taps.assign(tap_layers.size(), nullptr);
    std::vector<int32_t> rows, tokens;
    std::vector<int64_t> text_pos;
    std::vector<int64_t> row0(items.size());  // each item's first row in `rows`
    std::string key = cat("target:batch:", n_total);  // "target:": counted as the target's compute
    for (size_t i = 0; i < items.size(); ++i) {
        const batch_item & it = items[i];
        model_cache & c = *slots_[it.slot].cache;
        graph_inputs::seq_segment seg;
        seg.cache = &c;
        seg.tok0 = (int64_t) tokens.size();
        seg.n_tokens = (int64_t) it.tokens.size();
        seg.n_past = c.n_past;
        seg.n_kv = std::min(c.n_ctx, kv_padded(c.n_past + seg.n_tokens));  // as run_chunk pads it
        seg.record_tape = it.kind == BATCH_VERIFY;
        g.segs.push_back(seg);
        row0[i] = (int64_t) rows.size();
        std::vector<int64_t> seg_pos(seg.n_tokens);
        if (!it.parents.empty()) tree_positions(c.n_past, seg.n_tokens, it.parents.data(), seg_pos.data());
        for (int64_t j = 0; j < seg.n_tokens; ++j) {
            const bool row = it.kind == BATCH_VERIFY || (it.kind == BATCH_DECODE && j == seg.n_tokens - 1);
            if (row) rows.push_back((int32_t) (seg.tok0 + j));
            text_pos.push_back(it.parents.empty() ? c.n_past + j : seg_pos[j]);
        }
        tokens.insert(tokens.end(), it.tokens.begin(), it.tokens.end());
        key += cat(",", seg.n_tokens, it.parents.empty() ? "PDV"[it.kind] : 'T');
    }
    // on a device, the taps of each slot with a feature queue stay there (set_slot_tap_queue)
    std::vector<int64_t> sink_col(items.size(), -1);
    std::string sunk;  // the items whose taps stay (the graph's copies into the queues)
    for (size_t i = 0; i < items.size() && !tap_layers.empty() && runner_->on_device(); ++i) {
        const tap_queue & q = slots_[items[i].slot].queue;
        if (!q.dst) continue;
        const int64_t n = g.segs[i].n_tokens;
        sink_col[i] = q.reserve(n);
        DFN_REQUIRE(sink_col[i] >= 0 && sink_col[i] + n <= q.dst->ne[1], "batch", "the tap queue of slot ", items[i].slot,
                    " holds ", q.dst->ne[1], " columns, not ", sink_col[i] + n);
        sunk += cat(",", i);
    }
    if (!sunk.empty()) key += ":sink" + sunk;
    key += argmax_only ? ":argmax:taps" : ":taps";
    for (int il : tap_layers) key += cat(",", il);
    const int64_t n_rows = (int64_t) rows.size();
    const bool all_rows = n_rows == n_total;

    ggml_tensor * rows_in = nullptr, * logits = nullptr, * argmax = nullptr;
    device_head head;  // on a device: the argmax in stock ops (device_heads.h)
    auto build = [&](const build_context & b) {
        static_cast<build_context &>(g) = b;
        g.any_width = true;  // every column as alone, however wide the pass (build_context.h)
        ggml_context * ctx = b.ctx;
        g.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_total);
        g.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_total * model_->n_pos_per_token());
        ggml_set_input(g.tokens);
        ggml_set_input(g.pos);
        for (size_t i = 0; i < items.size(); ++i) {
            graph_inputs::seq_segment & s = g.segs[i];
            s.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, s.n_kv, s.n_tokens);
            ggml_set_input(s.kq_mask);
            if (!items[i].parents.empty()) {
                s.tree_parents = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, s.n_tokens);
                ggml_set_input(s.tree_parents);
            }
        }
        ggml_tensor * hidden = model_->build_forward(g);  // [n_embd, n_total]
        for (size_t i = 0; i < items.size(); ++i) {
            const graph_inputs::seq_segment & s = g.segs[i];
            if (sink_col[i] >= 0) sink_tap_columns(b, g.taps, s.tok0, s.n_tokens, slots_[items[i].slot].queue.dst, sink_col[i]);
        }
        if (n_rows == 0) {
            ggml_build_forward_expand(g.gf, hidden);
            return;
        }
        if (!all_rows) {
            // the rows asked for (an exact copy): their logits are the one-sequence pass's, as the
            // matmul computes each column alone
            rows_in = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
            ggml_set_input(rows_in);
            hidden = ggml_get_rows(ctx, hidden, rows_in);  // [n_embd, n_rows]
        }
        logits = matmul(g, model_->output, hidden);  // [n_vocab, n_rows]
        if (argmax_only && b.device) {
            head = device_argmax(b, logits, /*with_p=*/false);  // as the one-sequence pass's (build_chunk)
            argmax = head.ids;
            return;
        }
        // the greedy tokens by the AR step's op (it flags non-finite rows: top1.h)
        ggml_tensor * res = argmax_only ? (argmax = argmax_op(ctx, logits)) : logits;  // I32 [n_rows]
        ggml_set_output(res);
        ggml_build_forward_expand(g.gf, res);
    };
    auto set_inputs = [&] {
        ggml_backend_tensor_set(g.tokens, tokens.data(), 0, tokens.size() * sizeof(int32_t));
        std::vector<int32_t> pos(n_total * model_->n_pos_per_token());
        model_->fill_positions_at(text_pos.data(), n_total, pos.data());
        if (g.pos->buffer) ggml_backend_tensor_set(g.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
        for (size_t i = 0; i < items.size(); ++i) {
            const graph_inputs::seq_segment & s = g.segs[i];
            const int32_t * parents = items[i].parents.empty() ? nullptr : items[i].parents.data();
            if (parents && s.tree_parents->buffer)
                ggml_backend_tensor_set(s.tree_parents, parents, 0, s.n_tokens * sizeof(int32_t));
            if (!s.kq_mask->buffer) continue;  // no attention layer reads it
            std::vector<ggml_fp16_t> mask((size_t) s.n_kv * s.n_tokens);
            if (parents) fill_tree_mask(s.n_past, s.n_tokens, s.n_kv, parents, mask.data());
            else fill_causal_mask(s.n_past, s.n_tokens, s.n_kv, mask.data());
            ggml_backend_tensor_set(s.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
        }
        if (rows_in) ggml_backend_tensor_set(rows_in, rows.data(), 0, rows.size() * sizeof(int32_t));
    };
    std::vector<decode_result> out(items.size());
    auto read_outputs = [&] {
        std::vector<float> all((size_t) (argmax_only ? 0 : n_rows) * hp.n_vocab);
        std::vector<int32_t> ids(argmax_only ? n_rows : 0);
        if (!all.empty()) ggml_backend_tensor_get(logits, all.data(), 0, all.size() * sizeof(float));
        if (!ids.empty() && head.ids) {
            // a non-finite row (its sum says so: ggml_argmax cannot) is marked as top1_op marks it
            const int64_t bad = read_device_head(head, ids.data(), nullptr);
            if (bad >= 0) ids[bad] = -1;
        } else if (!ids.empty()) {
            ggml_backend_tensor_get(argmax, ids.data(), 0, ids.size() * sizeof(int32_t));
        }
        std::vector<std::vector<float>> taps(tap_layers.size());
        const bool all_sunk = std::all_of(sink_col.begin(), sink_col.end(), [](int64_t c) { return c >= 0; });
        for (size_t t = 0; t < tap_layers.size() && !all_sunk; ++t) {
            taps[t].resize((size_t) hp.n_embd * n_total);
            ggml_backend_tensor_get(g.taps[t], taps[t].data(), 0, taps[t].size() * sizeof(float));
        }
        for (size_t i = 0; i < items.size(); ++i) {
            const graph_inputs::seq_segment & s = g.segs[i];
            decode_result & r = out[i];
            r.n_rows = items[i].kind == BATCH_VERIFY ? s.n_tokens : items[i].kind == BATCH_DECODE ? 1 : 0;
            const int64_t pos0 = s.n_past + s.n_tokens - r.n_rows;  // position of row 0
            const char * where = items[i].kind == BATCH_VERIFY ? "verify" : W;
            if (argmax_only) {
                r.argmax.assign(ids.begin() + row0[i], ids.begin() + row0[i] + r.n_rows);
                for (int64_t k = 0; k < r.n_rows; ++k) {
                    if (r.argmax[k] < 0) throw_non_finite_logits(where, pos0 + k);
                }
            } else {
                r.logits.assign(all.begin() + row0[i] * hp.n_vocab, all.begin() + (row0[i] + r.n_rows) * hp.n_vocab);
                for (size_t k = 0; k < r.logits.size(); ++k) {
                    if (!std::isfinite(r.logits[k])) throw_non_finite_logits(where, pos0 + (int64_t) k / hp.n_vocab);
                }
            }
            if (sink_col[i] >= 0) continue;  // in the slot's device queue
            // taps [n_tokens, n_taps, n_embd] as decode() gives them
            r.taps.resize((size_t) s.n_tokens * tap_layers.size() * hp.n_embd);
            for (int64_t j = 0; j < s.n_tokens; ++j) {
                for (size_t t = 0; t < tap_layers.size(); ++t) {
                    std::memcpy(r.taps.data() + ((size_t) j * tap_layers.size() + t) * hp.n_embd,
                                taps[t].data() + (size_t) (s.tok0 + j) * hp.n_embd, hp.n_embd * sizeof(float));
                }
            }
        }
    };
    for (const batch_item & it : items)  // a tree's GDN ops read its parents from the cache (verify_tree)
        if (!it.parents.empty()) arm_tree(*slots_[it.slot].cache, it.parents.data(), (int64_t) it.parents.size());
    runner_->run(key, build, set_inputs, read_outputs, "target:batch");  // one plan for every mix (a CPU runner)
    // the caches took the tokens (K/V rows, GDN state or tape) and the replay commit_slot deferred
    for (size_t i = 0; i < items.size(); ++i) {
        seq_slot & s = slots_[items[i].slot];
        const int64_t n = (int64_t) items[i].tokens.size();
        if (items[i].kind == BATCH_VERIFY) {
            s.pending_past = s.cache->n_past;
            s.pending_n = n;
            s.pending_tokens = items[i].tokens;
            s.pending_parents = items[i].parents;
        }
        s.cache->n_past += n;
        s.cache->replay_n = 0;
    }
    return out;
}

}  // namespace dfn
