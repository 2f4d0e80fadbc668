#include "session.h"

#include "alloc.h"
#include "common.h"
#include "gdn_tape.h"
#ifdef DFN_CUDA
#include "cuda/gdn_tape_cuda.h"
#endif
#include "graph.h"
#include "matmul.h"
#include "profile.h"
#include "top1.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace dfn {

static const char * W = "decode";

target_session::target_session(const std::string & path, const session_params & params) : params_(params) {
    install_ggml_log();
    DFN_REQUIRE(params.n_ctx >= 1, "engine", "n_ctx must be >= 1, got ", params.n_ctx);
    DFN_REQUIRE(params.n_batch >= 1, "engine", "n_batch must be >= 1, got ", params.n_batch);
    DFN_REQUIRE(params.n_threads >= 0, "engine", "n_threads must be >= 0, got ", params.n_threads);
    DFN_REQUIRE(params.kv_type == GGML_TYPE_F16 || params.kv_type == GGML_TYPE_F32, "engine",
                "kv_type must be f16 or f32");
    DFN_REQUIRE(params.max_verify >= 0, "engine", "max_verify must be >= 0");
    DFN_REQUIRE(params.rollback == "tape" || params.rollback == "snapshot" || params.rollback == "redecode", "engine",
                "rollback must be 'tape', 'snapshot' or 'redecode', got '", params.rollback, "'");
    DFN_REQUIRE(params.matmul == "own" || params.matmul == "ggml", "engine",
                "matmul must be 'own' or 'ggml', got '", params.matmul, "'");
    const bool want_gpu = params.device == "gpu" || params.device == "cuda" || params.device == "metal";
    DFN_REQUIRE(want_gpu || params.device == "cpu", "engine", "unknown device '", params.device, "' (use 'cpu' or 'gpu')");

    model_ = target_model::open(path);

    require_headroom(size_t(4) << 20, "engine", "the ggml CPU backend");  // its ggml_init aborts on failure
    cpu_.reset(ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr));
    if (!cpu_) throw runtime_error("[engine] cannot initialise the ggml CPU backend");
    const int n_threads = params.n_threads > 0 ? params.n_threads : (int) std::max(1u, std::thread::hardware_concurrency());
    params_.n_threads = n_threads;
    ggml_backend_cpu_set_n_threads(cpu_.get(), n_threads);
    backend_ = cpu_.get();
    if (want_gpu) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        DFN_REQUIRE(dev != nullptr, "engine", "device='", params.device, "' asked for, but the ggml this package runs "
                    "on was built without a GPU backend. Reinstall llama-cpp-python with one, e.g. "
                    "CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir "
                    "llama-cpp-python==0.3.36, then reinstall dflash-native");
        gpu_.reset(ggml_backend_dev_init(dev, nullptr));
        if (!gpu_) throw runtime_error(cat("[engine] cannot initialise GPU device ", ggml_backend_dev_name(dev)));
        backend_ = gpu_.get();
    }

    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend_);
    model_->load_weights(buft);
    cache_ = std::make_unique<model_cache>(model_->hparams(), params.n_ctx, params.kv_type, params.max_verify,
                                           params.rollback == "snapshot", buft);

    max_nodes_ = std::max<size_t>(2048, (size_t) model_->hparams().n_layer * 96 + 256);
    meta_.resize(ggml_tensor_overhead() * max_nodes_ + ggml_graph_overhead_custom(max_nodes_, false));
}

// What ggml_backend_sched_new mallocs without checking (ggml-backend.cpp): an arena of graph_size *
// GGML_SCHED_MAX_SPLIT_INPUTS (30) * 2 tensors plus a graph, four id arrays as long, hash tables.
static size_t sched_bytes(size_t graph_size) {
    const size_t n = graph_size * 30 * 2;
    return n * (sizeof(ggml_tensor) + 4 * sizeof(int)) + ggml_graph_overhead_custom(graph_size, false) +
           graph_size * 64 + (size_t(1) << 20);
}

void target_session::make_room(size_t bytes, const std::string & what, const std::string & keep_key) {
    try {
        require_headroom(bytes, "graph", what);
    } catch (const memory_error &) {
        // the other plans' schedulers and compute buffers are only a cache: drop them and retry
        for (auto it = plans_.begin(); it != plans_.end();) it = it->first == keep_key ? std::next(it) : plans_.erase(it);
        require_headroom(bytes, "graph", what);
    }
}

target_session::graph_plan target_session::new_plan(const std::string & shape_key, ggml_cgraph * gf) {
    for (int attempt = 0;; ++attempt) {
        make_room(sched_bytes(max_nodes_), cat("the scheduler of graph '", shape_key, "'"), "");
        ggml_backend_t backends[2] = {backend_, cpu_.get()};
        graph_plan p;
        p.sched.reset(ggml_backend_sched_new(backends, nullptr, gpu_ ? 2 : 1, max_nodes_, false, true));
        if (!p.sched) throw runtime_error("[engine] cannot create the ggml scheduler");
        if (ggml_backend_sched_reserve(p.sched.get(), gf)) return p;
        const std::string why = last_ggml_error();  // names the buffer and its size
        if (attempt == 0 && !plans_.empty()) {
            plans_.clear();  // their compute buffers are only a cache; try again without them
            continue;
        }
        throw memory_error(cat("[graph] out of memory: cannot allocate the compute buffers of graph '", shape_key, "'",
                               why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
    }
}

ggml_backend_sched_t target_session::plan_for(const std::string & shape_key, ggml_cgraph * gf) {
    auto it = plans_.find(shape_key);
    if (it == plans_.end()) {
        graph_plan p = new_plan(shape_key, gf);
        it = plans_.emplace(shape_key, std::move(p)).first;
        // drop the least recently used plans beyond the limits (never the one just made)
        auto bytes = [&](const graph_plan & q) {
            return ggml_backend_sched_get_buffer_size(q.sched.get(), backend_) +
                   (gpu_ ? ggml_backend_sched_get_buffer_size(q.sched.get(), cpu_.get()) : 0);
        };
        for (;;) {
            size_t total = 0;
            auto lru = plans_.end();
            for (auto jt = plans_.begin(); jt != plans_.end(); ++jt) {
                total += bytes(jt->second);
                if (jt != it && (lru == plans_.end() || jt->second.last_use < lru->second.last_use)) lru = jt;
            }
            if (lru == plans_.end() || (plans_.size() <= k_max_plans && total <= k_max_plan_bytes)) break;
            plans_.erase(lru);
        }
    }
    it->second.last_use = ++plan_clock_;
    return it->second.sched.get();
}

target_session::~target_session() = default;

std::string target_session::device_name() const { return ggml_backend_name(backend_); }

void target_session::check_tokens(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers) const {
    const target_hparams & hp = model_->hparams();
    DFN_REQUIRE(pending_n_ == 0, W, "a verify of ", pending_n_, " tokens is pending: commit() it first");
    DFN_REQUIRE(n > 0, W, "no tokens to decode");
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
    const target_hparams & hp = model_->hparams();
    check_tokens(tokens, n, tap_layers);

    decode_result out;
    out.n_rows = all_logits ? n : 1;
    if (argmax_only) out.argmax.resize(out.n_rows);
    else out.logits.resize((size_t) out.n_rows * hp.n_vocab);
    if (!tap_layers.empty()) out.taps.resize((size_t) n * tap_layers.size() * hp.n_embd);

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

decode_result target_session::verify(const int32_t * tokens, int64_t n, const std::vector<int> & tap_layers,
                                     bool argmax_only) {
    const target_hparams & hp = model_->hparams();
    check_tokens(tokens, n, tap_layers);
    DFN_REQUIRE(n <= cache_->n_tape || hp.is_gdn.empty(), "verify", n, " tokens > max_verify = ", cache_->n_tape,
                " (the GDN tape capacity this engine was created with)");
    DFN_REQUIRE(n <= params_.n_batch, "verify", n, " tokens > n_batch = ", params_.n_batch);

    decode_result out;
    out.n_rows = n;
    if (argmax_only) out.argmax.resize(n);
    else out.logits.resize((size_t) n * hp.n_vocab);
    if (!tap_layers.empty()) out.taps.resize((size_t) n * tap_layers.size() * hp.n_embd);
    const int64_t n_past0 = cache_->n_past;
    try {
        run_chunk(tokens, n, true, tap_layers, out, 0, n, true, argmax_only);
    } catch (...) {
        cache_->n_past = n_past0;  // GDN state was not touched by a verify pass
        throw;
    }
    pending_past_ = n_past0;
    pending_n_ = n;
    pending_tokens_.assign(tokens, tokens + n);
    return out;
}

void target_session::replay_state(const gdn_layer & L, int64_t S, int64_t H_v, int64_t n_keep) {
    const bool host = ggml_backend_buffer_is_host(L.ssm->buffer);
    if (host) {
        gdn_tape_replay_mt((float *) L.ssm->data, {(float *) L.tape_k->data, (float *) L.tape_u->data,
                           (float *) L.tape_g->data}, S, H_v, n_keep, params_.n_threads);
        return;
    }
#ifdef DFN_CUDA
    if (std::string(ggml_backend_buffer_name(L.ssm->buffer)).rfind("CUDA", 0) == 0) {
        // device buffers: replay in place with csrc/cuda/gdn_tape.cu
        ggml_backend_synchronize(backend_);
        cuda::gdn_tape_replay((float *) L.ssm->data, {(float *) L.tape_k->data, (float *) L.tape_u->data,
                              (float *) L.tape_g->data}, S, H_v, n_keep, nullptr);
        ggml_backend_synchronize(backend_);
        return;
    }
#endif
    // other devices: a host round trip through the CPU kernel
    std::vector<float> st(ggml_nelements(L.ssm)), tk(S * H_v * n_keep), tu(S * H_v * n_keep), tg(H_v * n_keep);
    ggml_backend_tensor_get(L.ssm, st.data(), 0, st.size() * sizeof(float));
    ggml_backend_tensor_get(L.tape_k, tk.data(), 0, tk.size() * sizeof(float));
    ggml_backend_tensor_get(L.tape_u, tu.data(), 0, tu.size() * sizeof(float));
    ggml_backend_tensor_get(L.tape_g, tg.data(), 0, tg.size() * sizeof(float));
    gdn_tape_replay_mt(st.data(), {tk.data(), tu.data(), tg.data()}, S, H_v, n_keep, params_.n_threads);
    ggml_backend_tensor_set(L.ssm, st.data(), 0, st.size() * sizeof(float));
}

void target_session::commit(int64_t n_keep) {
    DFN_REQUIRE(pending_n_ > 0, "commit", "no verify is pending");
    DFN_REQUIRE(n_keep >= 1 && n_keep <= pending_n_, "commit", "n_keep = ", n_keep, " outside [1, ", pending_n_, "]");
    profile_scope timer("target", ":commit");
    const target_hparams & hp = model_->hparams();
    cache_->n_past = pending_past_ + n_keep;  // attention: dead rows past the cursor are overwritten later
    pending_n_ = 0;
    if (hp.is_gdn.empty()) return;
    if (params_.rollback == "redecode") {
        // baseline: the GDN state is still the one before the verify; run the kept tokens again
        cache_->n_past = pending_past_;
        decode(pending_tokens_.data(), n_keep, false);
        return;
    }

    const int64_t S = hp.ssm_head_dim, H_v = hp.ssm_n_v_heads, n_ch = hp.ssm_conv_channels();
    const int64_t kc = hp.ssm_d_conv - 1;
    bool defer = false;
    for (int il = 0; il < hp.n_layer; ++il) {
        if (!hp.is_gdn[il]) continue;
        gdn_layer & L = cache_->gdn[il];
        if (L.snapshots) {
            // baseline: copy the state after token n_keep - 1 back
            const size_t bytes = ggml_nbytes(L.ssm);
            if (ggml_backend_buffer_is_host(L.ssm->buffer)) {
                std::memcpy(L.ssm->data, (const char *) L.snapshots->data + (n_keep - 1) * bytes, bytes);
            } else {
                std::vector<uint8_t> tmp(bytes);
                ggml_backend_tensor_get(L.snapshots, tmp.data(), (n_keep - 1) * bytes, bytes);
                ggml_backend_tensor_set(L.ssm, tmp.data(), 0, bytes);
            }
        } else if (ggml_backend_buffer_is_host(L.ssm->buffer)) {
            defer = true;  // the next graph's GDN op replays it (cache.h: replay_n)
        } else {
            replay_state(L, S, H_v, n_keep);
        }

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

void target_session::flush_replay() {
    if (cache_->replay_n == 0) return;
    const target_hparams & hp = model_->hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        if (hp.is_gdn[il]) replay_state(cache_->gdn[il], hp.ssm_head_dim, hp.ssm_n_v_heads, cache_->replay_n);
    }
    cache_->replay_n = 0;
}

void target_session::run_chunk(const int32_t * tokens, int64_t n, bool all_logits, const std::vector<int> & tap_layers,
                               decode_result & out, int64_t tok_offset, int64_t n_total, bool record_tape,
                               bool argmax_only) {
    const target_hparams & hp = model_->hparams();
    const bool last_chunk = tok_offset + n == n_total;
    const bool want_logits = all_logits || last_chunk;

    graph_inputs g;
    g.hp = &hp;
    g.cache = cache_.get();
    g.n_tokens = n;
    g.n_past = cache_->n_past;
    // the live prefix, padded (session.h; the mask hides the rest, and padded keys change no bits)
    g.n_kv = std::min(cache_->n_ctx, kv_padded(g.n_past + n));
    g.record_tape = record_tape;
    g.tap_layers = tap_layers;
    g.taps.assign(tap_layers.size(), nullptr);
    const int n_pos = model_->n_pos_per_token();
    ggml_tensor * logits = nullptr;
    ggml_tensor * argmax = nullptr;

    auto build = [&](ggml_context * ctx, ggml_cgraph * gf) {
        g.ctx = ctx;
        g.gf = gf;
        g.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        g.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n * n_pos);
        g.kq_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g.n_kv, n);
        ggml_set_input(g.tokens);
        ggml_set_input(g.pos);
        ggml_set_input(g.kq_mask);

        ggml_tensor * hidden = model_->build_forward(g);  // [n_embd, n]
        if (want_logits) {
            if (!all_logits) {
                hidden = ggml_view_2d(ctx, hidden, hp.n_embd, 1, hidden->nb[1], (n - 1) * hidden->nb[1]);
            }
            logits = matmul(ctx, model_->output, hidden);  // [n_vocab, rows]
            if (argmax_only) {
                argmax = own_kernels() ? argmax_op(ctx, logits) : ggml_argmax(ctx, logits);  // I32 [rows]
                ggml_set_output(argmax);
                ggml_build_forward_expand(gf, argmax);
            } else {
                ggml_set_output(logits);
                ggml_build_forward_expand(gf, logits);
            }
        } else {
            ggml_build_forward_expand(gf, hidden);
        }
    };

    auto set_inputs = [&] {
        ggml_backend_tensor_set(g.tokens, tokens, 0, n * sizeof(int32_t));
        std::vector<int32_t> pos(n * n_pos, 0);
        for (int64_t i = 0; i < n; ++i) {
            const int32_t p = (int32_t) (g.n_past + i);
            for (int s = 0; s < std::min(n_pos, 3); ++s) pos[s * n + i] = p;  // 4th section (if any) stays 0
        }
        ggml_backend_tensor_set(g.pos, pos.data(), 0, pos.size() * sizeof(int32_t));
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        std::vector<ggml_fp16_t> mask((size_t) g.n_kv * n);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t p = g.n_past + i;
            ggml_fp16_t * row = mask.data() + (size_t) i * g.n_kv;
            for (int64_t j = 0; j < g.n_kv; ++j) row[j] = j <= p ? zero : ninf;
        }
        ggml_backend_tensor_set(g.kq_mask, mask.data(), 0, mask.size() * sizeof(ggml_fp16_t));
    };

    auto read_outputs = [&] {
        cache_->n_past += n;
        cache_->replay_n = 0;  // the GDN ops of this graph took the replay commit() deferred
        if (argmax) {
            ggml_backend_tensor_get(argmax, out.argmax.data() + (all_logits ? tok_offset : 0), 0,
                                    ggml_nelements(argmax) * sizeof(int32_t));
        } else if (want_logits) {
            const int64_t rows = all_logits ? n : 1;
            float * dst = out.logits.data() + (all_logits ? (size_t) tok_offset * hp.n_vocab : 0);
            ggml_backend_tensor_get(logits, dst, 0, (size_t) rows * hp.n_vocab * sizeof(float));
            for (int64_t i = 0; i < rows * hp.n_vocab; ++i) {
                if (!std::isfinite(dst[i])) {
                    throw runtime_error(cat("[decode] non-finite logits (", dst[i], ") at token ", tok_offset + i / hp.n_vocab,
                                            ": the model weights or inputs produce NaN/inf"));
                }
            }
        }
        const size_t n_taps = tap_layers.size();
        for (size_t t = 0; t < n_taps; ++t) {
            // taps[t]: [n_embd, n] -> out.taps[token][t][:]
            std::vector<float> buf((size_t) hp.n_embd * n);
            ggml_backend_tensor_get(g.taps[t], buf.data(), 0, buf.size() * sizeof(float));
            for (int64_t i = 0; i < n; ++i) {
                std::memcpy(out.taps.data() + (((size_t) (tok_offset + i)) * n_taps + t) * hp.n_embd,
                            buf.data() + (size_t) i * hp.n_embd, hp.n_embd * sizeof(float));
            }
        }
    };

    std::string key = cat("target:", n, all_logits ? ":all" : ":last", want_logits ? ":logits" : ":hidden",
                          record_tape ? ":tape" : "", argmax_only ? ":argmax" : "", ":taps");
    for (int il : tap_layers) key += cat(",", il);
    run_graph(key, build, set_inputs, read_outputs);
}

void target_session::run_graph(const std::string & shape_key, const std::function<void(ggml_context *, ggml_cgraph *)> & build,
                               const std::function<void()> & set_inputs, const std::function<void()> & read_outputs) {
    const int prof = profile_level();
    profile_graph pg{shape_key.substr(0, shape_key.find(':')), prof ? profile_now() : 0.0};
    auto phase = [&](const char * what) {
        if (!prof) return;
        const double now = profile_now();
        profile_add(pg.graph, what, now - pg.last);
        pg.last = now;
    };
    if (!broken_.empty()) throw runtime_error(cat("[graph] ", broken_, ": this engine cannot run any more, create a new one"));
    ggml_init_params ip = {meta_.size(), meta_.data(), /*no_alloc =*/ true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) throw runtime_error("[graph] ggml_init failed");
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> ctx_guard(ctx, ggml_free);
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, max_nodes_, false);
    {
        matmul_scope own(params_.matmul == "own");
        build(ctx, gf);
    }
    phase(":build");
    ggml_backend_sched_t sched = plan_for(shape_key, gf);
    phase(":plan");
    sched = alloc_graph(shape_key, gf, sched);
    phase(":alloc");
    set_inputs();
    phase(":inputs");
    // ggml's CPU backend allocates its work buffer, threadpool and OpenMP threads without a check
    // that survives failure (a failed work buffer leaves a dangling pointer behind): make room first
    const size_t work = backend_ == cpu_.get() ? ggml_graph_plan(gf, params_.n_threads, nullptr).work_size : 0;
    make_room(graph_headroom(params_.n_threads) + work, cat("running graph '", shape_key, "'"), shape_key);
    ggml_backend_sched_set_eval_callback(sched, prof >= 2 ? profile_eval_cb : nullptr, prof >= 2 ? &pg : nullptr);
    ggml_status st;
    try {
        st = ggml_backend_sched_graph_compute(sched, gf);
    } catch (const std::bad_alloc &) {
        // thrown by a backend's allocation inside ggml: its state may be inconsistent
        broken_ = cat("out of memory inside ggml while running graph '", shape_key, "'");
        (void) cpu_.release();  // may hold a freed work buffer: never free it again
        throw memory_error(cat("[graph] ", broken_, "; this engine cannot run any more, create a new one"));
    }
    throw_kernel_oom("graph");
    if (st == GGML_STATUS_ALLOC_FAILED) throw memory_error(cat("[graph] out of memory running graph '", shape_key, "'"));
    if (st != GGML_STATUS_SUCCESS) throw runtime_error(cat("[graph] compute failed with status ", (int) st));
    phase(":compute");
    read_outputs();
    phase(":read");
}

ggml_backend_sched_t target_session::alloc_graph(const std::string & shape_key, ggml_cgraph * gf,
                                                 ggml_backend_sched_t sched) {
    for (int attempt = 0;; ++attempt) {
        // a graph that outgrew its plan is planned again: ggml's allocator tables (unchecked)
        make_room(max_nodes_ * 64 + (size_t(1) << 20), cat("allocating graph '", shape_key, "'"), shape_key);
        ggml_backend_sched_reset(sched);
        if (ggml_backend_sched_alloc_graph(sched, gf)) return sched;
        // the graph outgrew its plan (the KV length grew) and the larger buffers did not fit
        const std::string why = last_ggml_error();
        plans_.erase(shape_key);
        if (attempt > 0) {
            throw memory_error(cat("[graph] out of memory: cannot allocate the compute buffers of graph '", shape_key,
                                   "'", why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
        }
        plans_.clear();  // only a cache: plan again without the others
        sched = plan_for(shape_key, gf);
    }
}

std::vector<float> target_session::read_tensor_f32(const ggml_tensor * t, int64_t n_rows_dim2) const {
    // Reads t (or its first n_rows_dim2 slices along dim 2) as F32.
    const int64_t ne2 = n_rows_dim2 >= 0 ? n_rows_dim2 : t->ne[2];
    const size_t n_el = (size_t) t->ne[0] * t->ne[1] * ne2 * t->ne[3];
    std::vector<float> out(n_el);
    if (n_el == 0) return out;
    const size_t bytes = n_el * ggml_type_size(t->type) / ggml_blck_size(t->type);
    std::vector<uint8_t> raw(bytes);
    ggml_backend_tensor_get(t, raw.data(), 0, bytes);
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(out.data(), raw.data(), bytes);
    } else if (t->type == GGML_TYPE_F16) {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) raw.data(), out.data(), (int64_t) n_el);
    } else {
        throw runtime_error(cat("[cache] cannot read tensor of type ", ggml_type_name(t->type)));
    }
    return out;
}

}  // namespace dfn
