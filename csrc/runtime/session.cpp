#include "runtime/session.h"

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
    const size_t max_nodes = std::max<size_t>(2048, (size_t) model_->hparams().n_layer * 96 + 256);
    runner_ = std::make_unique<graph_runner>(params.device, n_threads, params.matmul, max_nodes);

    // by layer over the devices of a split (graph_runner::target_buffer_type); one device or the CPU:
    // one buffer type, so the file is mapped where it can be (gguf_file::load_weights)
    const int n_layer = model_->hparams().n_layer;
    model_->load_weights([&](const ggml_tensor * t) { return runner_->target_buffer_type(t->name, n_layer); },
                         params.use_mmap);
    tune_matmul(*runner_, model_->file().tensors());  // each weight type's matmul level (dispatch.h)
    rollback_ = make_gdn_rollback(params.rollback);
    cache_ = std::make_unique<model_cache>(model_->hparams(), params.n_ctx, params.kv_type, params.max_verify,
                                           rollback_->keeps_snapshots(), runner_->on_device(),
                                           [&](int il) { return runner_->layer_buffer_type(il, n_layer); });
}

target_session::~target_session() = default;

memory_usage target_session::memory() const {
    memory_usage m;
    m.target_weights_mapped = model_->file().mapped_bytes();
    m.target_weights_copied = model_->file().copied_bytes();
    m.kv_cache = cache_->kv_bytes();
    m.gdn_state = cache_->gdn_state_bytes();
    m.gdn_tape = cache_->gdn_tape_bytes();
    m.compute_target = runner_->compute_bytes({"target:", "commit:"});
    return m;
}

void target_session::check_tokens(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers) const {
    const target_hparams & hp = model_->hparams();
    DFN_REQUIRE(pending_n_ == 0, W, "a verify of ", pending_n_, " tokens is pending: commit() it first");
    DFN_REQUIRE(n > 0, W, "empty input: no tokens to decode");
    DFN_REQUIRE(cache_->n_past + n <= cache_->n_ctx, W, "context overflow: ", cache_->n_past, " cached + ", n,
                " new tokens > n_ctx = ", cache_->n_ctx);
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
    if (constraint) return choose_constrained(*constraint, row, p, cache_->n_past, W, lp);
    return choose_token(row, p, cache_->n_past, W, lp);
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
    pending_past_ = n_past0;
    pending_n_ = n;
    pending_tokens_.assign(tokens, tokens + n);
    return out;
}

decode_result target_session::verify_tree(const int32_t * tokens, const int32_t * parents, int64_t n,
                                          const std::vector<int> & tap_layers, bool argmax_only) {
    const sink_reset once{sink_};  // the tap sink (set_tap_sink) serves this call only, whatever happens
    const target_hparams & hp = model_->hparams();
    check_tokens(tokens, n, tap_layers);
    check_tree_parents(parents, n, "verify");
    DFN_REQUIRE(n <= std::max<int64_t>(params_.max_verify, 1), "verify", "a tree of ", n, " nodes > max_verify = ",
                params_.max_verify, " (the verify capacity this engine was created with)");
    DFN_REQUIRE(n <= params_.n_batch, "verify", n, " nodes > n_batch = ", params_.n_batch);
    DFN_REQUIRE(rollback_->supports_tree() || hp.is_gdn.empty(), "verify", "tree verify needs tape rollback");
    cache_->tree.parents.assign(parents, parents + n);  // the GDN ops' (gdn_tape.h: gdn_tree_pass)
    cache_->tree.replay_n = cache_->replay_n;
    decode_result out = run_verify(tokens, parents, n, tap_layers, argmax_only);
    pending_parents_.assign(parents, parents + n);
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
    DFN_REQUIRE(pending_n_ > 0 && !pending_parents_.empty(), "commit", "no tree verify is pending");
    DFN_REQUIRE(!path.empty() && path[0] == 0, "commit", "the accepted path must start at the root (node 0)");
    for (size_t d = 1; d < path.size(); ++d) {
        DFN_REQUIRE(path[d] > 0 && path[d] < pending_n_ && pending_parents_[path[d]] == path[d - 1], "commit",
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
            compact_rows(L.k, L.k->nb[2], L.k->nb[2], pending_past_, path);
            compact_rows(L.v, L.v->nb[2], L.v->nb[2], pending_past_, path);
        }
    }
    for (size_t d = 0; d < path.size(); ++d) pending_tokens_[d] = pending_tokens_[path[d]];
    pending_parents_.clear();
    commit((int64_t) path.size());
}

void target_session::replay_state(const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep) {
    // host memory only (a device replays in its commit graph: commit_on_device)
    gdn_tape_replay_mt((float *) L.ssm->data, {(float *) L.tape_k->data, (float *) L.tape_u->data,
                       (float *) L.tape_g->data}, S, H_v, n_keep, params_.n_threads);
}

void target_session::commit(int64_t n_keep) {
    DFN_REQUIRE(pending_n_ > 0, "commit", "no verify is pending");
    DFN_REQUIRE(n_keep >= 1 && n_keep <= pending_n_, "commit", "n_keep = ", n_keep, " outside [1, ", pending_n_, "]");
    profile_scope timer("target", ":commit");
    pending_parents_.clear();
    const target_hparams & hp = model_->hparams();
    cache_->n_past = pending_past_ + n_keep;  // attention: dead rows past the cursor are overwritten later
    const int64_t n_verified = pending_n_;
    pending_n_ = 0;
    if (hp.is_gdn.empty()) return;
    if (rollback_->redecodes()) {
        // the GDN state is still the one before the verify: run the kept tokens again
        cache_->n_past = pending_past_;
        decode(pending_tokens_.data(), n_keep, false);
        return;
    }

    if (runner_->on_device()) {
        commit_on_device(n_keep, n_verified);
        return;
    }
    const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads, n_ch = hp.ssm_conv_channels();
    const int64_t kc = hp.ssm_d_conv - 1;
    bool defer = false;
    for (int il = 0; il < hp.n_layer; ++il) {
        if (!hp.is_gdn[il]) continue;
        gdn_layer & L = cache_->gdn[il];
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
    if (defer) cache_->replay_n = n_keep;
}

void target_session::commit_on_device(int64_t n_keep, int64_t n_verified) {
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
            const gdn_layer & L = cache_->gdn[il];
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

void target_session::flush_replay() {
    if (cache_->replay_n == 0) return;
    const target_hparams & hp = model_->hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        if (hp.is_gdn[il]) replay_state(cache_->gdn[il], hp.ssm_head_dim, hp.ssm_n_v_heads, cache_->replay_n);
    }
    cache_->replay_n = 0;
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
    if (c.sink) {
        // taps[t] F32 [n_embd, n] -> rows [t * n_embd, (t + 1) * n_embd) of sink columns col0..
        ggml_tensor * d = c.sink;
        for (size_t t = 0; t < g.taps.size(); ++t) {
            const int64_t ne = g.taps[t]->ne[0];
            ggml_tensor * view = ggml_view_2d(ctx, d, ne, n, d->nb[1], c.sink_col0 * d->nb[1] + t * ne * sizeof(float));
            ggml_build_forward_expand(g.gf, ggml_cpy(ctx, g.taps[t], view));
        }
    }
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

void target_session::set_tree_inputs(const chunk_graph & c) const {
    const graph_inputs & g = c.g;
    const int64_t n = g.n_tokens;
    std::vector<int64_t> depth(n, 0), text_pos(n);
    for (int64_t i = 1; i < n; ++i) depth[i] = depth[c.parents[i]] + 1;
    for (int64_t i = 0; i < n; ++i) text_pos[i] = g.n_past + depth[i];
    std::vector<int32_t> pos(n * model_->n_pos_per_token());
    model_->fill_positions_at(text_pos.data(), n, pos.data());
    if (g.pos->buffer) ggml_backend_tensor_set(g.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
    // each node sees the committed rows and its ancestors (and itself) among the tree's rows
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    std::vector<ggml_fp16_t> mask((size_t) g.n_kv * n, ninf);
    for (int64_t i = 0; i < n; ++i) {
        ggml_fp16_t * row = mask.data() + (size_t) i * g.n_kv;
        for (int64_t j = 0; j < g.n_past; ++j) row[j] = zero;
        for (int64_t a = i; a >= 0; a = c.parents[a]) row[g.n_past + a] = zero;
    }
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
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    std::vector<ggml_fp16_t> mask((size_t) g.n_kv * n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = g.n_past + i;
        ggml_fp16_t * row = mask.data() + (size_t) i * g.n_kv;
        for (int64_t j = 0; j < g.n_kv; ++j) row[j] = j <= p ? zero : ninf;
    }
    if (g.kq_mask->buffer) ggml_backend_tensor_set(g.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
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
    g.cache = cache_.get();
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

}  // namespace dfn
