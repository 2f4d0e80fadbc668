// The C API (include/dflash_native.h) over the core: the engine (target_session, spec_session,
// tokenizer) and the generation loop of python/dflash_native/engine.py's _Run without text (no
// stop strings, no prompt cache, no logprobs): the same steps in the same order, so the tokens
// equal Engine.generate's. Every entry point catches everything; failures become a dfn_status
// and the calling thread's dfn_last_error(). An engine with n_seq > 1 runs every dfn_generate as a
// ticket of its scheduler (engine/scheduler.h: run_ticket), so calls from several threads batch.
#define DFN_BUILDING_LIBRARY
#include "dflash_native.h"

#include "base/alloc.h"
#include "base/common.h"
#include "base/profile.h"
#include "models/drafter.h"
#include "gguf/gguf_file.h"
#include "kernels/cpu/constraint.h"
#include "kernels/cpu/sampler.h"
#include "runtime/session.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "spec/spec.h"
#include "gguf/tokenizer.h"

#include <sys/stat.h>
#if !defined(_WIN32)
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <mutex>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace dfn;

static long current_pid() {
#if defined(_WIN32)
    return 0;  // no fork()
#else
    return (long) getpid();
#endif
}

struct dfn_engine {
    std::unique_ptr<target_session> target;
    std::unique_ptr<spec_session> spec;  // after target: destroyed first (it refers to the target)
    std::unique_ptr<tokenizer> tok;      // null: the GGUF has no vocabulary
    // n_seq > 1: the scheduler over the target's slots, which runs every dfn_generate (destroyed
    // first: its slots' spec sessions refer to the target and to spec's drafter); null: n_seq = 1
    std::unique_ptr<scheduler> sched;
    bool tree = false;
    dfn_stats stats{};
    // n_seq = 1: a dfn_generate is running: another (from a second thread, or from its own token
    // callback) is refused rather than left to corrupt the sequence or abort in ggml
    std::atomic<bool> busy{false};
    // n_seq > 1: the dfn_generate calls running (dfn_engine_destroy refuses the engine while any
    // runs); each thread's last statistics, by thread_key(); the first drafter failure a call saw
    std::atomic<int> calls{0};
    mutable std::mutex mu;  // guards thread_stats (the map: each entry is its own thread's) and failure
    std::unordered_map<uint64_t, dfn_stats> thread_stats;
    std::string failure;
    // the process that made it: in a fork() of that process a graph would wait for ever on ggml's
    // OpenMP worker threads, which fork() does not copy (dfn_generate refuses to run there)
    long pid = current_pid();
};

namespace {

// The engines dfn_engine_create made and dfn_engine_destroy has not freed: a handle used after its
// destroy (or destroyed twice) is refused with DFN_ERR_INVALID_ARGUMENT instead of being
// dereferenced, as long as no newer engine took its address (the header says so).
std::mutex g_live_mu;
std::unordered_set<const dfn_engine *> g_live;
const char * k_not_live = "engine is not a live engine: destroyed already, or not made by dfn_engine_create";

bool live(const dfn_engine * e) {
    std::lock_guard<std::mutex> lock(g_live_mu);
    return e && g_live.count(e) != 0;
}

// dfn_generate's entry, under the lock dfn_engine_destroy checks under: the engine live, then
// n_seq = 1: claimed (busy; a running call refuses it), n_seq > 1: one more call running.
enum class entry { dead, busy, ok };
entry enter(dfn_engine * e) {
    std::lock_guard<std::mutex> lock(g_live_mu);
    if (!g_live.count(e)) return entry::dead;
    if (e->sched) {
        e->calls += 1;
        return entry::ok;
    }
    bool idle = false;
    return e->busy.compare_exchange_strong(idle, true) ? entry::ok : entry::busy;
}

// This thread's number for its statistics on n_seq > 1 engines (never reused, unlike thread ids).
uint64_t thread_key() {
    static std::atomic<uint64_t> next{0};
    thread_local const uint64_t key = ++next;
    return key;
}

// The statistics dfn_generate fills and dfn_engine_last_stats reads: the engine's (n_seq = 1) or
// the calling thread's on it (n_seq > 1; null from find_stats before its first call).
dfn_stats & stats_of(dfn_engine & e) {
    if (!e.sched) return e.stats;
    std::lock_guard<std::mutex> lock(e.mu);
    return e.thread_stats[thread_key()];  // the map's nodes stay put; only this thread touches its own
}
const dfn_stats * find_stats(const dfn_engine & e) {
    if (!e.sched) return &e.stats;
    std::lock_guard<std::mutex> lock(e.mu);
    auto it = e.thread_stats.find(thread_key());
    return it == e.thread_stats.end() ? nullptr : &it->second;
}

}  // namespace

namespace {

thread_local std::string t_last_error;

dfn_status fail(dfn_status s, const std::string & msg) {
    t_last_error = msg;
    return s;
}

// A dfn_constraint callback returned an error: DFN_ERR_CONSTRAINT at the boundary.
struct constraint_failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Runs f (returning dfn_status) with every exception turned into a status. During engine
// creation (creating = true) an input_error about the file is DFN_ERR_FILE; the core's option
// checks say "[engine] ..." and stay DFN_ERR_INVALID_ARGUMENT.
template <typename F>
dfn_status guarded(const char * where, F && f, bool creating = false) noexcept {
    try {
        return f();
    } catch (const memory_error & e) {
        return fail(DFN_ERR_OUT_OF_MEMORY, e.what());
    } catch (const std::bad_alloc &) {
        return fail(DFN_ERR_OUT_OF_MEMORY, cat("[", where, "] out of memory"));
    } catch (const constraint_failure & e) {
        return fail(DFN_ERR_CONSTRAINT, e.what());
    } catch (const input_error & e) {
        const std::string m = e.what();
        const bool option = m.rfind("[engine]", 0) == 0;
        return fail(creating && !option ? DFN_ERR_FILE : DFN_ERR_INVALID_ARGUMENT, m);
    } catch (const std::exception & e) {
        return fail(DFN_ERR_RUNTIME, e.what());
    } catch (...) {
        return fail(DFN_ERR_RUNTIME, cat("[", where, "] unknown exception"));
    }
}

// The ABI rule of the header: struct_size between the first release's size and ours.
template <typename T>
bool size_ok(const T * p, size_t first_release) {
    return p->struct_size >= first_release && p->struct_size <= sizeof(T);
}

constexpr size_t k_options_v1 = offsetof(dfn_engine_options, device_name);  // device_name came later
constexpr size_t k_generate_v1 = offsetof(dfn_generate_params, constraint);  // constraint came later
constexpr size_t k_constraint_v1 = sizeof(dfn_constraint);
constexpr size_t k_stats_v1 = offsetof(dfn_stats, drafter_failed);  // drafter_failed came later

// options' fields within struct_size over the defaults (the header's growth rule)
template <typename T>
T read_struct(const T * p, T defaults) {
    std::memcpy(&defaults, p, std::min(p->struct_size, sizeof(T)));
    defaults.struct_size = sizeof(T);
    return defaults;
}

// Whether the path names something: stat, never open (opening a FIFO for reading blocks until a
// writer comes); the core refuses what is not a regular GGUF file (gguf_file) before opening it.
bool file_exists(const char * path, std::string & why) {
    struct stat st;
    if (stat(path, &st) != 0) {
        why = std::strerror(errno);
        return false;
    }
    return true;
}

dfn_status create(const char * target_path, const char * drafter_path, const dfn_engine_options & o, dfn_engine ** out) {
    const char * W = "dfn_engine_create";
    std::string why;
    if (!file_exists(target_path, why)) return fail(DFN_ERR_FILE, cat("[", W, "] cannot open target '", target_path, "': ", why));
    if (drafter_path && !file_exists(drafter_path, why))
        return fail(DFN_ERR_FILE, cat("[", W, "] cannot open drafter '", drafter_path, "': ", why));
    // Engine.__init__'s checks of what the core does not check itself
    if (o.kv_type != DFN_KV_F16 && o.kv_type != DFN_KV_F32)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] kv_type must be DFN_KV_F16 or DFN_KV_F32, got ", o.kv_type));
    if (!o.device_name && o.device != DFN_DEVICE_CPU && o.device != DFN_DEVICE_GPU)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] device must be DFN_DEVICE_CPU or DFN_DEVICE_GPU, got ", o.device));
    if (o.reserved0 != 0)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] reserved0 must be 0, got ", o.reserved0));
    if (o.verify != DFN_VERIFY_CHAIN && o.verify != DFN_VERIFY_TREE)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] verify must be DFN_VERIFY_CHAIN or DFN_VERIFY_TREE, got ", o.verify));
    const bool tree = o.verify == DFN_VERIFY_TREE;
    if (tree && !drafter_path) return fail(DFN_ERR_INVALID_ARGUMENT, "[engine] verify=tree needs a drafter");
    if (tree && !(o.tree_budget >= 1 && o.tree_budget <= k_max_block_size - 1))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] tree_budget must be in [1, ", k_max_block_size - 1,
                                                  "] (the verify capacity ", k_max_block_size, " minus the root), got ",
                                                  o.tree_budget));
    if (o.block_size < 0) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] block_size must be >= 2 (or 0: the drafter's), got ", o.block_size));
    if (o.drafter_window < 0) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[engine] drafter_window must be >= 0, got ", o.drafter_window));

    auto e = std::make_unique<dfn_engine>();
    e->tree = tree;
    // Engine._load: the Target sized for the drafter's verify, the Spec, the tokenizer
    int64_t max_verify = 0;
    if (drafter_path) {
        max_verify = o.block_size ? o.block_size : drafter_block_size(gguf_file(drafter_path));
        if (tree) max_verify = std::max<int64_t>(max_verify, o.tree_budget + 1);
    }
    session_params p;
    p.n_ctx = o.n_ctx;
    p.n_threads = o.n_threads;
    p.kv_type = o.kv_type == DFN_KV_F32 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    p.n_batch = o.n_batch;
    p.device = o.device_name ? std::string(o.device_name) : o.device == DFN_DEVICE_GPU ? "gpu" : "cpu";
    p.max_verify = max_verify;
    p.matmul = MATMUL_OWN;  // the ggml baseline is for benchmarks (Engine.for_benchmark), not the C API
    p.use_mmap = o.use_mmap != 0;
    p.n_seq = o.n_seq;
    e->target = std::make_unique<target_session>(target_path, p);
    if (drafter_path) {
        spec_params s;
        s.block_size = o.block_size;
        s.ring_capacity = o.feature_ring_capacity;
        s.window = o.drafter_window;
        s.draft_cutoff = (float) o.draft_cutoff;
        s.draft_vocab = o.draft_vocab != 0;
        s.use_controller = o.gate != 0;
        s.tree_budget = tree ? o.tree_budget : 0;
        e->spec = std::make_unique<spec_session>(*e->target, drafter_path, s);
    }
    e->tok = tokenizer::load(target_path);
    if (e->tok && e->tok->n_vocab() > e->target->hparams().n_vocab)
        throw input_error(cat("[load_gguf] tokenizer has ", e->tok->n_vocab(), " tokens but the model's embedding has only ",
                              e->target->hparams().n_vocab, " rows"));
    if (o.n_seq > 1) e->sched = std::make_unique<scheduler>(*e->target, e->spec.get(), e->tok.get());
    e->stats.struct_size = sizeof(dfn_stats);
    *out = e.release();
    return DFN_OK;
}

// The caller's dfn_constraint as the core's token_constraint (kernels/cpu/constraint.h): each
// method calls its callback; a negative return throws constraint_failure.
// Its callbacks' seconds and the masks filled go to dfn_stats (constraint_s, n_masks).
class c_constraint final : public token_constraint {
public:
    explicit c_constraint(const dfn_constraint & c) : c_(c) {}
    void fill_mask(uint32_t * mask, int64_t n_words) override {
        std::fill(mask, mask + n_words, 0u);  // the header: the mask arrives all zero
        n_masks += 1;
        check(timed([&] { return c_.fill_mask(c_.user_data, mask, (size_t) n_words); }), "fill_mask", "");
    }
    bool accept(int32_t token) override {
        return check(timed([&] { return c_.accept(c_.user_data, token); }), "accept", cat(" (token ", token, ")")) > 0;
    }
    void rollback(int64_t n) override {
        if (n > 0) check(timed([&] { return c_.rollback(c_.user_data, (size_t) n); }), "rollback", cat(" (n = ", n, ")"));
    }
    bool terminated() override { return check(timed([&] { return c_.is_terminated(c_.user_data); }), "is_terminated", "") > 0; }

    double seconds = 0;
    int64_t n_masks = 0;

private:
    template <class F> int timed(F && f) {
        const double t0 = profile_now();
        const int r = f();
        seconds += profile_now() - t0;
        return r;
    }
    static int check(int r, const char * what, const std::string & args) {
        if (r < 0) throw constraint_failure(cat("[dfn_generate] the constraint's ", what, " callback returned ", r, args));
        return r;
    }
    dfn_constraint c_;
};

// A request's statistics (engine/request.h) and its constraint's as dfn_stats; n: the tokens
// written to the output.
void fill_stats(const request & r, dfn_stats & st, size_t n) {
    const request_stats & s = r.stats();
    if (const c_constraint * c = dynamic_cast<const c_constraint *>(r.policy().constraint)) {
        st.constraint_s = c->seconds;
        st.n_masks = c->n_masks;
    }
    st.n_prompt_tokens = s.n_prompt;
    st.n_generated = (int64_t) n;
    st.prefill_s = s.prefill_s;
    st.decode_s = s.decode_s;
    switch (s.stop) {
        case stop_reason::none: st.stop_reason = DFN_STOP_NONE; break;
        case stop_reason::eos: st.stop_reason = DFN_STOP_EOS; break;
        case stop_reason::length: st.stop_reason = DFN_STOP_LENGTH; break;
        case stop_reason::context: st.stop_reason = DFN_STOP_CONTEXT; break;
        case stop_reason::caller: st.stop_reason = DFN_STOP_CALLBACK; break;
    }
    st.speculative = r.policy().speculative;
    st.block_size = r.policy().speculative ? (int32_t) r.block_size() : 0;
    st.rounds = s.rounds();
    st.ar_steps = s.ar_steps;
    st.controller_switches = s.controller_switches;
    st.verified_tokens = s.verified_tokens;
    st.draft_s = s.draft_s;
    st.verify_s = s.verify_s;
    st.rollback_s = s.rollback_s;
    for (size_t k = 0; k < s.histogram.size() && k <= DFN_MAX_BLOCK_SIZE; ++k) st.acceptance_histogram[k] = s.histogram[k];
    st.drafter_failed = !s.drafter_failure.empty();
}

// dfn_generate on an engine with n_seq > 1: the request as a ticket of the engine's scheduler,
// batched with the other calls' (engine/scheduler.h); next() hands this thread its tokens (stepping
// the engine for every call while no other thread does), each shown to the callback here. A
// nonzero answer cancels the ticket; the tokens it made before the cancel took hold are dropped.
dfn_status run_ticket(dfn_engine & e, const request_policy & pol, const int32_t * prompt, size_t n_prompt, int32_t * out,
                      dfn_token_callback cb, void * user, size_t * n_out, dfn_stats & st) {
    scheduler & s = *e.sched;
    std::shared_ptr<scheduler::ticket> t = s.submit(std::vector<int32_t>(prompt, prompt + n_prompt), pol);
    size_t n = 0;
    bool stopped = false;
    struct settle {  // on every way out: *n_out, no ticket left running, the statistics
        dfn_engine & e;
        scheduler & s;
        scheduler::ticket & t;
        const size_t & n;
        const bool & stopped;
        size_t * n_out;
        dfn_stats mine;  // st as dfn_generate set it (the seed): a nested call on this thread rewrites st
        dfn_stats & st;
        ~settle() {
            *n_out = n;
            if (!s.done(t)) {  // stopped by the callback, or a step failed under another request
                s.cancel(t);
                try {
                    while (!s.done(t)) s.next(t);
                } catch (...) {  // the slot frees at a later call's step
                }
            }
            const request * r = s.result(t);
            if (!r) return;  // never admitted
            fill_stats(*r, mine, n);
            // the request went on past the token the callback stopped at (another thread's step)
            if (stopped && r->output().size() > n) mine.stop_reason = DFN_STOP_CALLBACK;
            st = mine;
            const std::string & why = r->stats().drafter_failure;
            try {
                std::lock_guard<std::mutex> lock(e.mu);
                if (e.failure.empty() && !why.empty()) e.failure = why;
            } catch (...) {  // nothing crosses the C boundary
            }
        }
    } settled{e, s, *t, n, stopped, n_out, st, st};
    while (!stopped) {
        const request::emitted em = s.next(*t);
        for (int32_t tok : em.tokens) {
            out[n++] = tok;
            if (cb && cb(tok, user) != 0) {
                stopped = true;
                break;
            }
        }
        if (s.done(*t)) break;
    }
    return DFN_OK;
}

dfn_status generate(dfn_engine & e, const int32_t * prompt, size_t n_prompt, const dfn_generate_params & g, int32_t * out,
                    size_t max_tokens, dfn_token_callback cb, void * user, size_t * n_out) {
    // Engine.generate's checks: the sampling settings always (sampler.h), then speculative
    sampling_params sp;
    sp.temperature = g.temperature;
    sp.top_k = g.top_k;
    sp.top_p = g.top_p;
    sp.min_p = g.min_p;
    sp.seed = g.seed;
    check_sampling_params(sp);
    if (g.speculative < -1 || g.speculative > 1)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[generate] speculative must be -1, 0 or 1, got ", g.speculative));
    if (g.speculative == 1 && !e.spec)
        return fail(DFN_ERR_INVALID_ARGUMENT, "[generate] speculative=1 needs an engine created with a drafter");
    if (n_prompt > (size_t) INT64_MAX) return fail(DFN_ERR_INVALID_ARGUMENT, "[generate] n_prompt is too large");
    dfn_stats & st = stats_of(e);  // zeroed by dfn_generate
    const bool spec = g.speculative == -1 ? (bool) e.spec : g.speculative == 1;
    st.seed = sp.greedy() ? 0 : sp.seed;
    request_policy pol;
    pol.speculative = spec;
    pol.tree = spec && e.tree;
    if (!sp.greedy()) pol.sampling = sp;  // greedy: the argmax in the graph
    pol.max_tokens = (int64_t) std::min<size_t>(max_tokens, INT64_MAX);
    std::optional<c_constraint> constraint;
    if (g.constraint) pol.constraint = &constraint.emplace(read_struct(g.constraint, dfn_constraint{}));
    request r(*e.target, spec ? e.spec.get() : nullptr, e.tok.get(), pol);  // start() below is a cold start
    // n_seq > 1: r has checked the policy on this thread; the scheduler runs the request in a slot
    if (e.sched) return run_ticket(e, r.policy(), prompt, n_prompt, out, cb, user, n_out, st);
    struct count_out {  // *n_out and the statistics as they stand, also when a step throws
        const request & r;
        dfn_stats & st;
        size_t * n_out;
        size_t & n;
        ~count_out() {
            *n_out = n;
            fill_stats(r, st, n);
        }
    };
    size_t n = 0;
    count_out counted{r, st, n_out, n};
    // the tokens a call emitted into out, each shown to the callback; a nonzero answer ends the request
    auto take = [&](const request::emitted & em) {
        for (int32_t t : em.tokens) {
            out[n++] = t;
            if (cb && cb(t, user) != 0) {
                r.stop();  // DFN_STOP_CALLBACK
                return;
            }
        }
    };
    take(r.start(prompt, (int64_t) n_prompt));
    while (!r.done()) take(r.step());
    return DFN_OK;
}

}  // namespace

extern "C" {

const char * dfn_last_error(void) { return t_last_error.c_str(); }

const char * dfn_status_name(dfn_status s) {
    switch (s) {
        case DFN_OK: return "DFN_OK";
        case DFN_ERR_INVALID_ARGUMENT: return "DFN_ERR_INVALID_ARGUMENT";
        case DFN_ERR_FILE: return "DFN_ERR_FILE";
        case DFN_ERR_BUFFER_TOO_SMALL: return "DFN_ERR_BUFFER_TOO_SMALL";
        case DFN_ERR_NO_VOCABULARY: return "DFN_ERR_NO_VOCABULARY";
        case DFN_ERR_OUT_OF_MEMORY: return "DFN_ERR_OUT_OF_MEMORY";
        case DFN_ERR_RUNTIME: return "DFN_ERR_RUNTIME";
        case DFN_ERR_CONSTRAINT: return "DFN_ERR_CONSTRAINT";
    }
    return "DFN_ERR_UNKNOWN";
}

const char * dfn_version(void) { return DFN_VERSION_STRING; }
int dfn_version_number(void) { return DFN_VERSION_NUMBER; }

dfn_engine_options dfn_engine_options_default(void) {
    dfn_engine_options o;
    std::memset(&o, 0, sizeof o);
    o.struct_size = sizeof o;
    o.n_ctx = 4096;
    o.n_threads = 0;
    o.block_size = 0;
    o.n_batch = 512;
    o.kv_type = DFN_KV_F16;
    o.device = DFN_DEVICE_CPU;
    o.device_name = nullptr;
    o.verify = DFN_VERIFY_CHAIN;
    o.tree_budget = 32;
    o.gate = 1;
    o.feature_ring_capacity = 4096;
    o.drafter_window = 0;
    o.draft_cutoff = 0.0;
    o.draft_vocab = 1;
    o.use_mmap = 1;
    o.n_seq = 1;
    return o;
}

dfn_generate_params dfn_generate_params_default(void) {
    dfn_generate_params g;
    std::memset(&g, 0, sizeof g);
    g.struct_size = sizeof g;
    g.temperature = 0.0;
    g.top_k = 0;
    g.top_p = 1.0;
    g.min_p = 0.0;
    g.seed = 0;
    g.speculative = -1;
    g.constraint = nullptr;
    return g;
}

dfn_status dfn_engine_create(const char * target_path, const char * drafter_path, const dfn_engine_options * options,
                             dfn_engine ** out) {
    const char * W = "dfn_engine_create";
    if (!out) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] out must not be NULL"));
    *out = nullptr;
    if (!target_path) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] target_path must not be NULL"));
    if (options && !size_ok(options, k_options_v1))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] options->struct_size = ", options->struct_size,
                                                  " (set it with dfn_engine_options_default(); this library takes ",
                                                  k_options_v1, "..", sizeof(dfn_engine_options), ")"));
    const dfn_engine_options o = options ? read_struct(options, dfn_engine_options_default()) : dfn_engine_options_default();
    const dfn_status st = guarded(W, [&] { return create(target_path, drafter_path, o, out); }, true);
    if (st == DFN_OK && *out) {
        std::lock_guard<std::mutex> lock(g_live_mu);
        g_live.insert(*out);
    }
    return st;
}

dfn_status dfn_engine_destroy(dfn_engine * engine) {
    const char * W = "dfn_engine_destroy";
    if (!engine) return DFN_OK;
    {
        std::lock_guard<std::mutex> lock(g_live_mu);
        if (!g_live.count(engine)) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] ", k_not_live));
        if (engine->busy || engine->calls > 0)
            return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] the engine is running a dfn_generate: destroy it after "
                                                      "that call returns"));
        g_live.erase(engine);
    }
    try {
        delete engine;
    } catch (...) {  // destructors do not throw; nothing may cross the C boundary regardless
    }
    return DFN_OK;
}

int32_t dfn_engine_n_vocab(const dfn_engine * e) { return live(e) ? (int32_t) e->target->hparams().n_vocab : -1; }
int64_t dfn_engine_n_ctx(const dfn_engine * e) { return live(e) ? e->target->params().n_ctx : -1; }
int32_t dfn_engine_block_size(const dfn_engine * e) { return live(e) ? (e->spec ? (int32_t) e->spec->block_size() : 0) : -1; }
int32_t dfn_engine_eos_token(const dfn_engine * e) { return live(e) && e->tok ? e->tok->eos() : -1; }

dfn_status dfn_tokenize(const dfn_engine * e, const char * text, size_t n_text, int32_t * tokens, size_t capacity,
                        size_t * n_tokens) {
    const char * W = "dfn_tokenize";
    if (e && !live(e)) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] ", k_not_live));
    if (!e || !n_tokens || (!text && n_text) || (!tokens && capacity))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] engine and n_tokens must not be NULL, nor text or tokens "
                                                  "when their size is not 0"));
    *n_tokens = 0;
    if (!e->tok) return fail(DFN_ERR_NO_VOCABULARY, cat("[", W, "] the target GGUF has no tokenizer; pass token ids"));
    return guarded(W, [&] {
        const std::vector<int32_t> ids = e->tok->tokenize(std::string(text ? text : "", n_text));
        *n_tokens = ids.size();
        if (ids.size() > capacity)
            return fail(DFN_ERR_BUFFER_TOO_SMALL, cat("[", W, "] the text has ", ids.size(), " tokens; the buffer holds ", capacity));
        std::copy(ids.begin(), ids.end(), tokens);
        return DFN_OK;
    });
}

dfn_status dfn_detokenize(const dfn_engine * e, const int32_t * tokens, size_t n, char * text, size_t capacity,
                          size_t * n_bytes) {
    const char * W = "dfn_detokenize";
    if (e && !live(e)) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] ", k_not_live));
    if (!e || !n_bytes || (!tokens && n) || (!text && capacity))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] engine and n_bytes must not be NULL, nor tokens or text "
                                                  "when their size is not 0"));
    *n_bytes = 0;
    if (!e->tok) return fail(DFN_ERR_NO_VOCABULARY, cat("[", W, "] the target GGUF has no tokenizer"));
    return guarded(W, [&] {
        const std::string s = e->tok->detokenize(tokens, (int64_t) n);
        *n_bytes = s.size();
        if (s.size() > capacity)
            return fail(DFN_ERR_BUFFER_TOO_SMALL, cat("[", W, "] the text has ", s.size(), " bytes; the buffer holds ", capacity));
        std::memcpy(text, s.data(), s.size());
        if (s.size() < capacity) text[s.size()] = '\0';
        return DFN_OK;
    });
}

dfn_status dfn_generate(dfn_engine * e, const int32_t * prompt, size_t n_prompt, const dfn_generate_params * params,
                        int32_t * out, size_t max_tokens, dfn_token_callback cb, void * user, size_t * n_out) {
    const char * W = "dfn_generate";
    const char * nulls = "] engine and n_out must not be NULL, nor prompt or out when their size is not 0";
    if (!e) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, nulls));
    const entry entered = enter(e);
    if (entered == entry::dead) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] ", k_not_live));
    if (entered == entry::busy)
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] this engine is running another dfn_generate (on another "
                                                  "thread, or this call comes from its token callback): one engine "
                                                  "runs one call at a time"));
    struct idle_again {  // what enter() took
        dfn_engine & e;
        ~idle_again() {
            if (e.sched)
                e.calls -= 1;
            else
                e.busy = false;
        }
    } release{*e};
    if (e->pid != current_pid())
        return fail(DFN_ERR_RUNTIME, cat("[", W, "] this engine was made in process ", e->pid, ", and this process (",
                                         current_pid(), ") is a fork() of it: ggml's worker threads do not survive "
                                         "fork(), so it cannot run here; make engines in the process that uses them"));
    // a call that fails leaves DFN_STOP_NONE, not the statistics of the call before it
    dfn_stats & st = stats_of(*e);
    st = dfn_stats{};
    st.struct_size = sizeof(dfn_stats);
    if (!n_out || (!prompt && n_prompt) || (!out && max_tokens)) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, nulls));
    *n_out = 0;
    if (params && !size_ok(params, k_generate_v1))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] params->struct_size = ", params->struct_size,
                                                  " (set it with dfn_generate_params_default())"));
    dfn_generate_params g = params ? read_struct(params, dfn_generate_params_default()) : dfn_generate_params_default();
    if (params && params->struct_size < offsetof(dfn_generate_params, constraint) + sizeof g.constraint)
        g.constraint = nullptr;  // a caller compiled before the field (its padding is not a pointer)
    const dfn_constraint * c = g.constraint;
    if (c && !size_ok(c, k_constraint_v1))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] params->constraint->struct_size = ", c->struct_size,
                                                  " (set it to sizeof(dfn_constraint))"));
    if (c && !(c->fill_mask && c->accept && c->rollback && c->is_terminated)) {
        std::string null;
        for (auto [f, name] : {std::pair{(bool) c->fill_mask, "fill_mask"}, {(bool) c->accept, "accept"},
                               {(bool) c->rollback, "rollback"}, {(bool) c->is_terminated, "is_terminated"}})
            if (!f) null += null.empty() ? name : cat(", ", name);
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] params->constraint's callbacks must not be NULL: ", null));
    }
    return guarded(W, [&] { return generate(*e, prompt, n_prompt, g, out, max_tokens, cb, user, n_out); });
}

const char * dfn_engine_drafter_failure(const dfn_engine * e) {
    if (!live(e)) return nullptr;
    if (e->sched) {  // n_seq > 1: set once, by a finished call (a slot's spec session is its stepping thread's)
        std::lock_guard<std::mutex> lock(e->mu);
        return e->failure.empty() ? "" : e->failure.c_str();
    }
    return e->spec ? e->spec->drafter_failure().c_str() : "";
}

dfn_status dfn_engine_last_stats(const dfn_engine * e, dfn_stats * stats) {
    const char * W = "dfn_engine_last_stats";
    if (e && !live(e)) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] ", k_not_live));
    if (!e || !stats) return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] engine and stats must not be NULL"));
    if (!size_ok(stats, k_stats_v1))
        return fail(DFN_ERR_INVALID_ARGUMENT, cat("[", W, "] stats->struct_size = ", stats->struct_size,
                                                  " (set it to sizeof(dfn_stats))"));
    const size_t n = stats->struct_size;
    dfn_stats none{};  // n_seq > 1: this thread has not called dfn_generate on the engine yet
    const dfn_stats * mine = find_stats(*e);
    std::memcpy(stats, mine ? mine : &none, n);
    stats->struct_size = n;
    return DFN_OK;
}

}  // extern "C"
