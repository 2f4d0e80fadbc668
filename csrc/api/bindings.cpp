// pybind11 module dflash_native._core: the only file that knows about Python.
//
// One binder per area: module information (bind_module_info), verify primitives (bind_verify),
// the GDN tape (bind_tape), the sampling settings (bind_sampling), structured output's grammar
// seam (bind_constraint), the Target and Spec sessions
// (bind_target, bind_spec), and the hooks
// only tests and benchmarks call, in the submodule _core.testing (bind_testing_*).
#include "base/alloc.h"
#include "base/common.h"
#include "kernels/cpu/constraint.h"
#include "ggml-cpu.h"
#include "kernels/cpu/conv.h"
#include "base/cpu_isa.h"
#include "kernels/cpu/matmul/dispatch.h"
#include "kernels/cpu/matmul/quantize_act.h"
#include "kernels/cpu/matmul/wide_gemm.h"
#include "kernels/cpu/matmul/matmul.h"
#include "kernels/cpu/moe_experts.h"
#include "base/profile.h"
#include "kernels/cpu/sampler.h"
#include "kernels/cpu/top1.h"
#include "spec/tree.h"
#include "kernels/cpu/gdn_tape.h"
#include "spec/verify.h"
#include "gguf/vocab.h"
#include "runtime/devices.h"
#include "runtime/session.h"
#include "engine/scheduler.h"
#include "spec/spec.h"
#include "engine/request.h"
#include "gguf/tokenizer.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cctype>
#include <exception>
#include <memory>
#include <cstring>
#include <optional>
#include <thread>

namespace py = pybind11;
using namespace dfn;

namespace {

using farr = py::array_t<float, py::array::c_style | py::array::forcecast>;

ggml_type parse_kv_type(const std::string & s) {
    if (s == "f16") return GGML_TYPE_F16;
    if (s == "f32") return GGML_TYPE_F32;
    throw input_error(cat("[engine] kv_type must be 'f16' or 'f32', got '", s, "'"));
}

// The mode strings of Engine / Target, parsed once here: the core sees only the enums.
rollback_kind parse_rollback(const std::string & s) {
    if (s == "tape") return ROLLBACK_TAPE;
    if (s == "snapshot") return ROLLBACK_SNAPSHOT;
    if (s == "redecode") return ROLLBACK_REDECODE;
    throw input_error(cat("[engine] rollback must be 'tape', 'snapshot' or 'redecode', got '", s, "'"));
}

matmul_kind parse_matmul(const std::string & s) {
    if (s == "own") return MATMUL_OWN;
    if (s == "ggml") return MATMUL_GGML;
    throw input_error(cat("[engine] matmul must be 'own' or 'ggml', got '", s, "'"));
}

std::vector<int32_t> to_tokens(const py::handle & obj) {
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> a;
    try {
        a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
    } catch (const py::error_already_set &) {
        a = py::array_t<int64_t>();
    }
    if (!a || a.ndim() != 1) throw input_error("[decode] tokens must be a 1-D sequence of integers");
    std::vector<int32_t> out(a.size());
    for (py::ssize_t i = 0; i < a.size(); ++i) {
        const int64_t t = a.at(i);
        if (t < INT32_MIN || t > INT32_MAX) throw input_error(cat("[decode] token id ", t, " at index ", i, " is out of range"));
        out[i] = (int32_t) t;
    }
    return out;
}

py::array_t<float> to_array(std::vector<float> && v, std::vector<py::ssize_t> shape) {
    auto * heap = new std::vector<float>(std::move(v));
    py::capsule owner(heap, [](void * p) { delete static_cast<std::vector<float> *>(p); });
    return py::array_t<float>(shape, heap->data(), owner);  // zero-copy: the array owns the vector
}

// decode_result -> Python: logits float32 [n_rows, n_vocab], and with taps the tuple (logits,
// taps float32 [n_tokens, n_taps, n_embd]).
py::object result_to_py(decode_result && r, int64_t n_tokens, size_t n_taps, const target_hparams & hp) {
    py::array_t<float> logits = to_array(std::move(r.logits), {r.n_rows, hp.n_vocab});
    if (n_taps == 0) return logits;
    py::array_t<float> t = to_array(std::move(r.taps), {n_tokens, (py::ssize_t) n_taps, hp.n_embd});
    return py::make_tuple(logits, t);
}

// A cache or ring tensor (or its first n_rows_dim2 slices along dim 2) as F32, for inspection.
std::vector<float> read_tensor_f32(const ggml_tensor * t, int64_t n_rows_dim2 = -1) {
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

// ---- module information -----------------------------------------------------------------------

void bind_module_info(py::module_ & m) {
    m.def("cpu_uses_openmp", &cpu_uses_openmp, "True when ggml's CPU backend runs its graphs on OpenMP's thread pool (which fork() does not copy)");
    m.def("gpu_available", [] { return local_gpu() != nullptr; },
          "True when the ggml this package runs on has a GPU device on this machine (CUDA, Metal, Vulkan, ...)");
    m.def("rpc_available", &rpc_available, "True when the ggml in use has the RPC backend (GGML_RPC=ON)");
    m.def("devices", [] {
        py::list out;
        for (const device_info & d : list_devices()) {
            py::dict e;
            e["name"] = d.name;
            e["description"] = d.description;
            e["type"] = d.type;
            e["memory_free"] = d.memory_free;
            e["memory_total"] = d.memory_total;
            out.append(e);
        }
        return out;
    }, "ggml's devices: a dict per device (name, description, type, memory_free, memory_total)");
    m.def("ggml_version", &ggml_version_string, "ggml's version and build commit: '0.25.3 (commit abc1234)'");
    m.def("backends", [] {
        py::list out;
        for (const backend_info & b : list_backends()) {
            py::dict features;
            for (const auto & [k, v] : b.features) features[py::str(k)] = v;
            out.append(py::make_tuple(b.name, features));
        }
        return out;
    }, "ggml's registered backends: (name, {feature: value}) per backend");
    m.def("resolve_device", [](const std::string & spec) {
        ggml_backend_dev_t d = resolve_device(spec);
        return std::string(d ? ggml_backend_dev_name(d) : "CPU");
    }, py::arg("device"), "The ggml device name an Engine device string names (ValueError when none)");
    m.def("rpc_serve", [](const std::string & host, int port, const std::string & device, int n_threads,
                          const std::string & cache_dir) {
        py::gil_scoped_release release;
        rpc_serve(host, port, device, n_threads, cache_dir);
    }, py::arg("host"), py::arg("port"), py::arg("device") = "cpu", py::arg("n_threads") = 1,
       py::arg("cache_dir") = "", "Serve a device over ggml's RPC protocol until the process ends (blocks)");
    m.def("isa", [] { return isa_description(); },
          "The instruction set the package's own CPU kernels run ('avx512f', 'avx2' or 'portable'; "
          "' (capped)' when DFLASH_NATIVE_ISA or set_isa holds it below the CPU's best)");
    m.def("set_isa", [](const std::string & name) { set_isa_cap(name); }, py::arg("name"),
          "Cap the own kernels' instruction set: 'avx512', 'avx2', 'portable', or '' for the CPU's best");
    m.def("isa_check", [] { isa_check(); }, "Raise ValueError when DFLASH_NATIVE_ISA is not one this CPU runs");

    // What Python reads from a GGUF before (or besides) loading it, through the same checked parser.
    m.def(
        "check_vocab",
        [](const std::string & path) -> py::tuple {
            gguf_file f(path);  // parsed once for both answers
            const bool has_vocab = check_vocab(f);
            const char * key = "tokenizer.chat_template";
            if (!has_vocab || !f.has_key(key)) return py::make_tuple(has_vocab, py::none());
            const std::string v = f.get_str(key);
            return py::make_tuple(true, py::reinterpret_steal<py::object>(
                                            PyUnicode_DecodeUTF8(v.data(), (py::ssize_t) v.size(), "replace")));
        },
        py::arg("path"),
        "Validate tokenizer.ggml.* (vocab.h): (False, None) when the file has no vocabulary, else (True, its "
        "tokenizer.chat_template or None); ValueError when the vocabulary is broken");
    m.def(
        "drafter_block_size", [](const std::string & path) { return drafter_block_size(gguf_file(path)); },
        py::arg("path"), "dflash.block_size of a drafter GGUF (16 when absent), range-checked");
    m.def(
        "profile",
        [](int level) {
            DFN_REQUIRE(level >= 0 && level <= 2, "profile", "level must be 0, 1 or 2, got ", level);
            profile_set_level(level);
            profile_reset();
        },
        py::arg("level"),
        "Start op timing (profile.h): 0 off, 1 graph phases, 2 also every node (computed one at a time). Clears totals.");
    m.def(
        "profile_report",
        [] {
            py::dict out;
            for (const profile_entry & e : profile_report()) out[py::str(e.key)] = py::make_tuple(e.calls, e.seconds);
            return out;
        },
        "Totals since profile(): {'<graph>/<op or :phase>': (calls, seconds)}");
}

// ---- verify primitives ------------------------------------------------------------------------

void bind_verify(py::module_ & m) {
    m.def(
        "accept_prefix",
        [](const py::object & draft, const py::object & target) {
            std::vector<int32_t> d = to_tokens(draft), t = to_tokens(target);
            return accept_prefix(d.data(), (int64_t) d.size(), t.data(), (int64_t) t.size());
        },
        py::arg("draft"), py::arg("target"),
        "Committed tokens of one chain-verify round: the longest prefix of draft (d_1..d_{B-1}) equal to "
        "target (t_0..t_{B-1}), plus the bonus token.");
    m.def(
        "accept_tree",
        [](const py::object & parents, const py::object & tokens, const py::object & target) {
            std::vector<int32_t> p = to_tokens(parents), t = to_tokens(tokens), a = to_tokens(target);
            DFN_REQUIRE(p.size() == t.size() && a.size() == t.size(), "accept_tree", "parents, tokens and target_argmax ",
                        "must have one entry per node (got ", p.size(), ", ", t.size(), ", ", a.size(), ")");
            return accept_tree(p.data(), t.data(), a.data(), (int64_t) t.size());
        },
        py::arg("parents"), py::arg("tokens"), py::arg("target_argmax"),
        "Committed tokens of one tree-verify round: the accepted root-to-node path (without the root) "
        "plus the bonus token (csrc/spec/verify.h: accept_tree).");
}

// ---- GDN tape ---------------------------------------------------------------------------------

struct tape_dims {
    int64_t T, H_k, H_v, S;
};

// q, k: [T, H_k, S]; v: [T, H_v, S]; g, beta: [T, H_v]; state0: [H_v, S(v), S(k)] (S^T per head)
tape_dims check_record_shapes(const farr & q, const farr & k, const farr & v, const farr & g, const farr & beta,
                              const farr & state0) {
    if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || g.ndim() != 2 || beta.ndim() != 2 || state0.ndim() != 3)
        throw input_error("[gdn_tape] expected q, k, v 3-D; g, beta 2-D; state0 3-D");
    const int64_t T = v.shape(0), H_v = v.shape(1), S = v.shape(2), H_k = q.shape(1);
    if (H_k < 1 || H_v % H_k != 0 || q.shape(0) != T || q.shape(2) != S || k.shape(0) != T || k.shape(1) != H_k ||
        k.shape(2) != S || g.shape(0) != T || g.shape(1) != H_v || beta.shape(0) != T || beta.shape(1) != H_v ||
        state0.shape(0) != H_v || state0.shape(1) != S || state0.shape(2) != S)
        throw input_error("[gdn_tape] inconsistent shapes");
    return {T, H_k, H_v, S};
}

// state: [H_v, S, S]; tape_k, tape_u: [T, H_v, S]; tape_g: [T, H_v]; 0 <= n <= T
template <typename State>
tape_dims check_replay_shapes(const State & state, const farr & tk, const farr & tu, const farr & tg, int64_t n) {
    if (state.ndim() != 3 || tk.ndim() != 3 || tu.ndim() != 3 || tg.ndim() != 2)
        throw input_error("[gdn_tape] expected state, tape_k, tape_u 3-D and tape_g 2-D");
    const int64_t H_v = state.shape(0), S = state.shape(1), T = tk.shape(0);
    if (state.shape(2) != S || tk.shape(1) != H_v || tk.shape(2) != S || tu.shape(0) != T || tu.shape(1) != H_v ||
        tu.shape(2) != S || tg.shape(0) != T || tg.shape(1) != H_v)
        throw input_error("[gdn_tape] inconsistent shapes");
    if (n < 0 || n > T) throw input_error(cat("[gdn_tape] n = ", n, " outside [0, ", T, "]"));
    return {T, 0, H_v, S};
}

gdn_tape_view tape_view(const farr & tk, const farr & tu, const farr & tg) {
    return {const_cast<float *>(tk.data()), const_cast<float *>(tu.data()), const_cast<float *>(tg.data())};
}

// (o, tape_k, tape_u, tape_g) -> Python, shaped as the inputs
py::tuple record_to_py(const tape_dims & d, std::vector<float> && o, std::vector<float> && tk, std::vector<float> && tu,
                       std::vector<float> && tg) {
    return py::make_tuple(to_array(std::move(o), {d.T, d.H_v, d.S}), to_array(std::move(tk), {d.T, d.H_v, d.S}),
                          to_array(std::move(tu), {d.T, d.H_v, d.S}), to_array(std::move(tg), {d.T, d.H_v}));
}

void bind_tape(py::module_ & m) {
    m.def(
        "gdn_tape_record",
        [](farr q, farr k, farr v, farr g, farr beta, farr state0) {
            const tape_dims d = check_record_shapes(q, k, v, g, beta, state0);
            const int64_t S = d.S, H_k = d.H_k, H_v = d.H_v, T = d.T;
            gdn_inputs in{q.data(), S, S * H_k, k.data(), S, S * H_k, v.data(), S, S * H_v, g.data(), H_v, beta.data(), H_v};
            std::vector<float> o(S * H_v * T), tk(S * H_v * T), tu(S * H_v * T), tg(H_v * T);
            {
                py::gil_scoped_release release;
                gdn_tape_record(in, state0.data(), o.data(), {tk.data(), tu.data(), tg.data()}, S, H_k, H_v, T, 0, H_v);
            }
            return record_to_py(d, std::move(o), std::move(tk), std::move(tu), std::move(tg));
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state0"),
        "Run the GDN recurrence from state0 recording the tape: returns (o, tape_k, tape_u, tape_g).");
    m.def(
        "gdn_tape_replay",
        [](farr state0, farr tk, farr tu, farr tg, int64_t n, int n_threads) {
            const tape_dims d = check_replay_shapes(state0, tk, tu, tg, n);
            std::vector<float> st(state0.data(), state0.data() + state0.size());
            {
                py::gil_scoped_release release;
                gdn_tape_replay_mt(st.data(), tape_view(tk, tu, tg), d.S, d.H_v, n, n_threads);
            }
            return to_array(std::move(st), {d.H_v, d.S, d.S});
        },
        py::arg("state0"), py::arg("tape_k"), py::arg("tape_u"), py::arg("tape_g"), py::arg("n"), py::arg("n_threads") = 1,
        "State after the first n tokens of a tape, from state0 ([H_v, S, S], S^T per head).");
}

// ---- sampling -----------------------------------------------------------------------------------

void bind_sampling(py::module_ & m) {
    py::class_<sampling_params>(m, "Sampling", "One request's sampling settings (sampler.h), checked when made")
        .def(py::init([](double temperature, int64_t top_k, double top_p, double min_p, uint64_t seed,
                         int64_t logprobs) {
                 sampling_params p;
                 p.temperature = temperature;
                 p.top_k = top_k;
                 p.top_p = top_p;
                 p.min_p = min_p;
                 p.seed = seed;
                 p.n_logprobs = logprobs;
                 check_sampling_params(p);
                 return p;
             }),
             py::arg("temperature"), py::arg("top_k") = 0, py::arg("top_p") = 1.0, py::arg("min_p") = 0.0,
             py::arg("seed") = 0, py::arg("logprobs") = -1)
        .def_readonly("temperature", &sampling_params::temperature)
        .def_readonly("top_k", &sampling_params::top_k)
        .def_readonly("top_p", &sampling_params::top_p)
        .def_readonly("min_p", &sampling_params::min_p)
        .def_readonly("seed", &sampling_params::seed)
        .def_readonly("logprobs", &sampling_params::n_logprobs, "alternatives per token's logprobs (-1: none)")
        .def("__repr__", [](const sampling_params & p) {
            return cat("Sampling(temperature=", p.temperature, ", top_k=", p.top_k, ", top_p=", p.top_p,
                       ", min_p=", p.min_p, ", seed=", p.seed, ", logprobs=", p.n_logprobs, ")");
        });
    m.attr("MAX_LOGPROBS") = k_max_logprobs;
    py::class_<token_logprobs>(m, "TokenLogprobs", "One committed token's log-probabilities (sampler.h)")
        .def_readonly("token", &token_logprobs::token)
        .def_readonly("logprob", &token_logprobs::logprob)
        .def_readonly("top_tokens", &token_logprobs::top_tokens, "the most probable tokens, most probable first")
        .def_readonly("top_logprobs", &token_logprobs::top_logprobs);
}

// ---- constraints (structured output) -------------------------------------------------------------

// A grammar written in Python (dflash_native/constraint.py): token_constraint's methods are its
// methods, called with the GIL taken (the core calls them from its compute, the GIL released).
// fill_mask gets the core's mask buffer itself, an int32 array [n_words], to fill in place.
struct py_token_constraint : token_constraint {
    py::function method(const char * name) const {
        py::function f = py::get_override(static_cast<const token_constraint *>(this), name);
        if (!f) throw runtime_error(cat("[constraint] ", name, " is not implemented"));
        return f;
    }
    void fill_mask(uint32_t * mask, int64_t n_words) override {
        py::gil_scoped_acquire gil;
        int32_t * p = reinterpret_cast<int32_t *>(mask);
        method("fill_mask")(py::array_t<int32_t>({(py::ssize_t) n_words}, {(py::ssize_t) sizeof(int32_t)}, p,
                                                 py::capsule(p, [](void *) {})));
    }
    bool accept(int32_t token) override {
        py::gil_scoped_acquire gil;
        return method("accept")(token).cast<bool>();
    }
    void rollback(int64_t n) override {
        py::gil_scoped_acquire gil;
        method("rollback")(n);
    }
    bool terminated() override {
        py::gil_scoped_acquire gil;
        return method("terminated")().cast<bool>();
    }
};

void bind_constraint(py::module_ & m) {
    py::class_<token_constraint, py_token_constraint>(
        m, "Constraint",
        "A grammar's hold on the next token (constraint.h), subclassed in Python: fill_mask(mask: int32 "
        "[ceil(n_vocab / 32)], bit t % 32 of word t // 32 = token t allowed; all zero once terminated), "
        "accept(token) -> bool, rollback(n), terminated() -> bool")
        .def(py::init<>());
}

// ---- Target -----------------------------------------------------------------------------------

std::unique_ptr<target_session> make_target_slots(const std::string & path, int64_t n_ctx, int n_threads,
                                                  const std::string & kv_type, int64_t n_batch, const std::string & device,
                                                  int64_t max_verify, const std::string & rollback,
                                                  const std::string & matmul, bool use_mmap, int n_seq) {
    session_params p;
    p.n_seq = n_seq;
    p.n_ctx = n_ctx;
    p.n_threads = n_threads;
    p.kv_type = parse_kv_type(kv_type);
    p.n_batch = n_batch;
    p.device = device;
    p.max_verify = max_verify;
    p.rollback = parse_rollback(rollback);
    p.matmul = parse_matmul(matmul);
    p.use_mmap = use_mmap;
    py::gil_scoped_release release;
    return std::make_unique<target_session>(path, p);
}

// The product's Target: the tape rollback and the batch-invariant matmul (the baselines are
// _core.testing.baseline_target's).
std::unique_ptr<target_session> make_target(const std::string & path, int64_t n_ctx, int n_threads,
                                            const std::string & kv_type, int64_t n_batch, const std::string & device,
                                            int64_t max_verify, bool use_mmap, int n_seq) {
    return make_target_slots(path, n_ctx, n_threads, kv_type, n_batch, device, max_verify, "tape", "own", use_mmap, n_seq);
}

py::object target_decode(target_session & s, const py::object & tokens, bool all_logits, const std::vector<int> & taps) {
    std::vector<int32_t> toks = to_tokens(tokens);
    decode_result r;
    {
        py::gil_scoped_release release;
        r = s.decode(toks.data(), (int64_t) toks.size(), all_logits, taps);
    }
    return result_to_py(std::move(r), (int64_t) toks.size(), taps.size(), s.hparams());
}

py::object target_verify(target_session & s, const py::object & tokens, const std::vector<int> & taps) {
    std::vector<int32_t> toks = to_tokens(tokens);
    decode_result r;
    {
        py::gil_scoped_release release;
        r = s.verify(toks.data(), (int64_t) toks.size(), taps);
    }
    return result_to_py(std::move(r), (int64_t) toks.size(), taps.size(), s.hparams());
}

// memory_usage as a dict of bytes, with its sum under "total" (Engine.memory_report).
py::dict memory_report(const target_session & t, const spec_session * s, scheduler * sched) {
    memory_usage u = t.memory();
    if (s) s->add_memory(u);
    graph_runner & r = const_cast<target_session &>(t).runner();
    py::list slots;  // a scheduler's slots: each one's caches, ring and feature queue (and their device bytes)
    for (int k = 0; sched && k < sched->n_slots(); ++k) {
        memory_usage m = t.slot_memory(k);
        if (spec_session * sk = sched->spec(k)) {
            sk->add_memory(m);
            if (k > 0) u.feature_ring += m.feature_ring, u.feature_queue += m.feature_queue;
        }
        py::dict d;
        d["kv_cache"] = m.kv_cache;
        d["gdn_state"] = m.gdn_state;
        d["gdn_tape"] = m.gdn_tape;
        d["feature_ring"] = m.feature_ring;
        d["feature_queue"] = m.feature_queue;
        d["on_device"] = r.on_device() ? m.kv_cache + m.gdn_state + m.gdn_tape + m.feature_ring : 0;
        slots.append(d);
    }
    if (r.on_device()) {
        u.on_device = u.target_weights_copied + u.drafter_weights_copied + u.kv_cache + u.gdn_state + u.gdn_tape +
                      u.feature_ring + r.compute_bytes({"target:", "commit:", "draft:", "encode:"}, /*device_only=*/true);
    }
    py::dict d;
    const std::pair<const char *, size_t> parts[] = {
        {"target_weights_mapped", u.target_weights_mapped}, {"target_weights_copied", u.target_weights_copied},
        {"drafter_weights_mapped", u.drafter_weights_mapped}, {"drafter_weights_copied", u.drafter_weights_copied},
        {"kv_cache", u.kv_cache}, {"gdn_state", u.gdn_state}, {"gdn_tape", u.gdn_tape},
        {"feature_ring", u.feature_ring}, {"feature_queue", u.feature_queue}, {"compute_target", u.compute_target}, {"compute_drafter", u.compute_drafter}};
    size_t total = 0;
    for (const auto & p : parts) {
        d[p.first] = p.second;
        total += p.second;
    }
    d["total"] = total;
    d["on_device"] = u.on_device;
    if (sched) d["slots"] = slots;
    return d;
}

void bind_target(py::module_ & m) {
    py::class_<target_session>(m, "Target")
        .def(py::init(&make_target), py::arg("path"), py::arg("n_ctx") = 4096, py::arg("n_threads") = 0,
             py::arg("kv_type") = "f16", py::arg("n_batch") = 512, py::arg("device") = "cpu", py::arg("max_verify") = 0,
             py::arg("use_mmap") = true, py::arg("n_seq") = 1)
        .def_property_readonly("n_seq", &target_session::n_seq)
        .def_property_readonly("threads_now", [](target_session & s) { return s.runner().threads_now(); },
                               "Threads its CPU graphs run on now (runtime/thread_governor.h)")
        .def_property_readonly("thread_reductions", [](target_session & s) { return s.runner().thread_reductions(); },
                               "Times the thread governor lowered the count (a busy machine)")
        .def_property_readonly("arch", [](const target_session & s) { return s.hparams().arch; })
        .def_property_readonly("n_vocab", [](const target_session & s) { return s.hparams().n_vocab; })
        .def_property_readonly("n_embd", [](const target_session & s) { return s.hparams().n_embd; })
        .def_property_readonly("n_layer", [](const target_session & s) { return s.hparams().n_layer; })
        .def_property_readonly("n_ctx", [](const target_session & s) { return s.params().n_ctx; })
        .def_property_readonly("n_threads", [](const target_session & s) { return s.params().n_threads; })
        .def_property_readonly("matmul", [](const target_session & s) { return s.params().matmul == MATMUL_OWN ? "own" : "ggml"; })
        .def_property_readonly("n_past", &target_session::n_past)
        .def_property_readonly("device", [](target_session & s) { return s.runner().device_name(); },
                               "The ggml device the graphs run on ('CPU', 'CUDA0', 'RPC0', ...)")
        .def_property_readonly("layer_types", [](const target_session & s) {
            std::vector<std::string> out;
            for (int il = 0; il < s.hparams().n_layer; ++il) out.push_back(s.hparams().layer_is_gdn(il) ? "gdn" : "attention");
            return out;
        })
        .def_property_readonly("weights_bytes", [](const target_session & s) { return s.model().file().weights_bytes(); })
        .def_property_readonly("cache_bytes", [](target_session & s) { return s.cache().bytes(); })
        .def_property_readonly("isa", [](target_session & s) {
            const std::string dev = s.runner().dispatch().deviations();
            return dev.empty() ? isa_description() : cat(isa_description(), "; ", dev);
        }, "The instruction set the own kernels run (dflash_native.isa()), and after '; ' the weight types "
           "whose matmul this engine measured faster at another (dispatch.h): 'avx512f; matmul q4_K x1 avx2'")
        .def("matmul_dispatch", [](target_session & s) {
            py::list out;
            for (const matmul_dispatch::choice & c : s.runner().dispatch().choices) {
                py::dict seconds;
                for (const auto & kv : c.seconds) seconds[isa_level_name(kv.first)] = kv.second;
                out.append(py::dict(py::arg("type") = ggml_type_name(c.type), py::arg("columns") = c.N,
                                    py::arg("tensor") = c.tensor, py::arg("rows") = c.rows, py::arg("K") = c.K,
                                    py::arg("seconds") = seconds, py::arg("chosen") = isa_level_name(c.level),
                                    py::arg("in_use") = isa_level_name(s.runner().dispatch().isa_for(c.type, c.N)),
                                    py::arg("wall_seconds") = c.wall));
            }
            return out;
        }, "The matmul levels this engine measured at load (dispatch.h), one dict per weight type and "
           "column count: the matrix timed, its fastest run per level (seconds), the level chosen and the one in use, "
           "and the measurement's own time (wall_seconds)")
        .def("memory_report", &memory_report, py::arg("spec") = nullptr, py::arg("scheduler") = nullptr,
             "Bytes held by this target and, given its Spec, the drafter beside it (see memory_usage in "
             "session.h): a dict of the parts and their total")
        .def("reset", &target_session::reset, "Empty the sequence: n_past = 0, GDN state zeroed")
        .def("decode", &target_decode, py::arg("tokens"), py::arg("all_logits") = false,
             py::arg("taps") = std::vector<int>{},
             "Run tokens at positions n_past.. and append them to the cache. Returns logits float32 "
             "[n_rows, n_vocab] (all tokens or the last), and with taps=[layers] also the hidden states "
             "after those layers, float32 [n_tokens, n_taps, n_embd].")
        .def(
            "decode_greedy",
            [](target_session & s, const py::object & tokens) {
                std::vector<int32_t> toks = to_tokens(tokens);
                py::gil_scoped_release release;
                return s.decode(toks.data(), (int64_t) toks.size(), false, {}, true).argmax[0];
            },
            py::arg("tokens"), "decode() that returns only the greedy next token (argmax of the last row, in the graph)")
        .def(
            "decode_sampled",
            [](target_session & s, const py::object & tokens, const sampling_params & p, token_constraint * c) {
                std::vector<int32_t> toks = to_tokens(tokens);
                py::gil_scoped_release release;
                return s.decode_sampled(toks.data(), (int64_t) toks.size(), p, nullptr, c);
            },
            py::arg("tokens"), py::arg("sampling"), py::arg("constraint") = py::none(),
            "decode() that returns the next token drawn by the sampler (Sampling) at its position")
        .def(
            "decode_logprobs",
            [](target_session & s, const py::object & tokens, const sampling_params & p, token_constraint * c) {
                std::vector<int32_t> toks = to_tokens(tokens);
                py::gil_scoped_release release;
                token_logprobs lp;
                s.decode_sampled(toks.data(), (int64_t) toks.size(), p, &lp, c);
                return lp;
            },
            py::arg("tokens"), py::arg("sampling"), py::arg("constraint") = py::none(),
            "decode_sampled() that returns the next token's TokenLogprobs (Sampling.logprobs >= 0; temperature 0: "
            "the argmax)")
        .def("verify", &target_verify, py::arg("tokens"), py::arg("taps") = std::vector<int>{},
             "Verify pass: all logits; GDN layers record their tape and keep their state. Follow with commit(n_keep).")
        .def(
            "verify_greedy",
            [](target_session & s, const py::object & tokens) {
                std::vector<int32_t> toks = to_tokens(tokens);
                py::gil_scoped_release release;
                return s.verify(toks.data(), (int64_t) toks.size(), {}, true).argmax;
            },
            py::arg("tokens"), "verify() that returns only the greedy token per row (what a chain round runs)")
        .def(
            "commit",
            [](target_session & s, int64_t n_keep) {
                py::gil_scoped_release release;
                s.commit(n_keep);
            },
            py::arg("n_keep"), "Keep the first n_keep tokens of the pending verify (rollback of the rest)");
}

// ---- Spec -------------------------------------------------------------------------------------

std::unique_ptr<spec_session> make_spec(target_session & t, const std::string & drafter, int64_t block_size,
                                        int64_t ring_capacity, int64_t window, float draft_cutoff, bool draft_vocab,
                                        bool controller, int64_t tree_budget) {
    spec_params p;
    p.tree_budget = tree_budget;
    p.use_controller = controller;
    p.draft_vocab = draft_vocab;
    p.block_size = block_size;
    p.ring_capacity = ring_capacity;
    p.window = window;
    p.draft_cutoff = draft_cutoff;
    py::gil_scoped_release release;
    return std::make_unique<spec_session>(t, drafter, p);
}

// Spec.round (fixed settings), Spec.step (the controller's choice) and their tree forms; with a
// Sampling, their sampled forms. `forced` (_core.testing's forms only): the spec's draft override
// for this call.
enum class round_kind { round, step, round_tree, step_tree };
template <round_kind kind>
round_result spec_round(spec_session & s, int32_t last, int64_t B, const py::object & forced,
                        const sampling_params * sampling, token_constraint * c) {
    if (B < 2) throw input_error(cat("[round] block size must be >= 2, got ", B));
    draft_override f;
    if (!forced.is_none()) {
        f = [d = to_tokens(forced)](int64_t) { return std::optional<std::vector<int32_t>>(d); };
    }
    py::gil_scoped_release release;
    constraint_scope scope(&s, c);
    draft_override_scope forced_scope(&s, std::move(f));
    switch (kind) {
        case round_kind::step: return s.step(last, B, sampling);
        case round_kind::round_tree: return s.round_tree(last, B, sampling);
        case round_kind::step_tree: return s.step_tree(last, B, sampling);
        default: return sampling ? s.round_sampled(last, B, *sampling) : s.round(last, B);
    }
}

// The Spec method of one round kind: spec_round without a forced draft.
template <round_kind kind>
round_result spec_round_unforced(spec_session & s, int32_t last, int64_t B, const sampling_params * sampling,
                                 token_constraint * c) {
    return spec_round<kind>(s, last, B, py::none(), sampling, c);
}

// The controller's estimates as they stand (engine stats, benchmarks, tests).
py::dict controller_state(spec_session & s) {
    const controller & c = s.control();
    py::dict d;
    d["mode"] = c.current() == controller::mode::ar ? "ar" : "spec";
    d["ar_s"] = c.ar_cost();
    d["draft_s"] = c.draft_cost();
    std::vector<double> v;
    for (int64_t n = 1; n <= s.block_size(); ++n) v.push_back(c.verify_cost(n));
    d["verify_s"] = v;  // [B]: c(1) .. c(B)
    d["spec_tok_s"] = c.spec_rate();
    d["switches"] = c.switches();
    std::vector<std::pair<int64_t, int64_t>> bins;
    for (int b = 0; b < controller::k_bins; ++b) bins.push_back(c.bin_counts(b));
    d["bins"] = bins;  // [k_bins]: (drafts observed, accepted) in the window, by drafter p-bin
    d["round_can_win"] = c.round_can_win();  // by the calibration's best case at the current costs
    d["regimes"] = c.n_regimes();            // sampling regimes with a calibration of their own
    d["stall_s"] = c.stall();                 // the mean wait per graph run of late (a busy machine)
    return d;
}

// What Spec.round returns: spec.h's round_result, its fields read-only.
void bind_round_result(py::module_ & m) {
    py::class_<round_result>(m, "RoundResult", "One speculative round's outcome (Spec.round)")
        .def_readonly("committed", &round_result::committed, "accepted drafts + bonus: 1..B token ids")
        .def_readonly("draft", &round_result::draft, "the drafts as verified: d_1 .. d_{n_verified-1}")
        .def_readonly("n_verified", &round_result::n_verified, "tokens in the verify pass: last + the drafts kept")
        .def_readonly("draft_s", &round_result::draft_s, "seconds drafting")
        .def_readonly("verify_s", &round_result::verify_s, "seconds in the verify pass")
        .def_readonly("rollback_s", &round_result::rollback_s, "seconds accepting and rolling back")
        .def_readonly("ar", &round_result::ar, "an AR step (Spec.step under the controller): one token, no draft")
        .def_readonly("parents", &round_result::parents, "tree rounds: the tree's parents (node 0 the root); else empty")
        .def_readonly("path", &round_result::path, "tree rounds: the accepted path's node indices, root first")
        .def_readonly("logprobs", &round_result::logprobs,
                      "one TokenLogprobs per committed token when the Sampling asked for them; else empty")
        .def("__repr__", [](const round_result & r) {
            return cat("RoundResult(committed=", r.committed.size(), " tokens, n_verified=", r.n_verified, ")");
        });
}

void spec_push_features(spec_session & s, farr feats, int64_t pos0) {
    if (feats.ndim() != 3) throw input_error("[feature_ring] features must be [m, n_taps, n_embd]");
    const auto & dh = s.drafter_hparams_();
    if (feats.shape(1) != (py::ssize_t) dh.tap_layers.size() || feats.shape(2) != dh.n_embd)
        throw input_error("[feature_ring] features must be [m, n_taps, n_embd] for this drafter");
    py::gil_scoped_release release;
    s.push_features(feats.data(), feats.shape(0), pos0);
}

// A drafting call of block size B (>= 2: `last` and at least one draft): f() with the GIL released.
template <class F>
auto drafting(int64_t B, F && f) {
    if (B < 2) throw input_error(cat("[draft] block size must be >= 2, got ", B));
    py::gil_scoped_release release;
    return f();
}

void def_spec_drafting(py::class_<spec_session> & c) {
    c.def("reset", &spec_session::reset)
        .def(
            "prefill",
            [](spec_session & s, const py::object & tokens, const sampling_params * sampling, int64_t n_cached,
               token_constraint * c) {
                std::vector<int32_t> t = to_tokens(tokens);
                py::gil_scoped_release release;
                constraint_scope scope(&s, c);
                if (sampling) return s.prefill_sampled(t.data(), (int64_t) t.size(), *sampling, nullptr, n_cached);
                return s.prefill(t.data(), (int64_t) t.size(), n_cached);
            },
            py::arg("tokens"), py::arg("sampling") = py::none(), py::arg("n_cached") = 0,
            py::arg("constraint") = py::none(),
            "Reset, run the prompt through the target with taps, fill the ring; returns the first token (the "
            "argmax, or with a Sampling its draw). n_cached > 0: the target and the ring already hold "
            "tokens[:n_cached] (the prompt cache); only the rest runs, without a reset")
        .def(
            "prefill_logprobs",
            [](spec_session & s, const py::object & tokens, const sampling_params & p, int64_t n_cached,
               token_constraint * c) {
                std::vector<int32_t> t = to_tokens(tokens);
                py::gil_scoped_release release;
                constraint_scope scope(&s, c);
                token_logprobs lp;
                s.prefill_sampled(t.data(), (int64_t) t.size(), p, &lp, n_cached);
                return lp;
            },
            py::arg("tokens"), py::arg("sampling"), py::arg("n_cached") = 0, py::arg("constraint") = py::none(),
            "prefill() that returns the first token's TokenLogprobs")
        .def(
            "draft",
            [](spec_session & s, int32_t last, int64_t B) { return drafting(B, [&] { return s.draft(last, B); }); },
            py::arg("last"), py::arg("block_size"))
        .def_property_readonly("selector_top_k", [](spec_session & s) { return s.drafter_hparams_().selector_top_k; },
                               "DFlash 2's selector_top_k (0: a drafter without a selector)")
        .def("round", &spec_round_unforced<round_kind::round>, py::arg("last"), py::arg("block_size"), py::arg("sampling") = py::none(), py::arg("constraint") = py::none(),
             "One round: draft, verify, accept, roll back, queue the committed features. Returns a RoundResult. "
             "With a Sampling: sampled drafts and target draws (spec_sampled.cpp)")
        .def("step", &spec_round_unforced<round_kind::step>, py::arg("last"), py::arg("block_size"), py::arg("sampling") = py::none(), py::arg("constraint") = py::none(),
             "The request's next step: under the controller an AR step or a round of the drafts it chose "
             "(RoundResult.ar tells which); without it, round(). With a Sampling: their sampled forms.")
        .def_property_readonly("controller_switches", [](spec_session & s) { return s.control().switches(); },
                               "The controller's switches between AR and speculation in this request")
        .def_property_readonly("drafter_failure", &spec_session::drafter_failure,
                               "Empty while the drafter is healthy; after a draft with non-finite logits, why: every "
                               "round (round, step, their tree and sampled forms) is then an AR step")
        .def(
            "ar_step",
            [](spec_session & s, int32_t last, const sampling_params * sampling, token_constraint * c) {
                py::gil_scoped_release release;
                constraint_scope scope(&s, c);
                if (sampling) return s.ar_step_sampled(last, *sampling);
                return s.ar_step(last);
            },
            py::arg("last"), py::arg("sampling") = py::none(), py::arg("constraint") = py::none(),
            "One exact AR step from `last` (the gate's probe), its features queued for the ring as a round's "
            "are; returns the greedy next token, or with a Sampling its draw")
        .def(
            "ar_step_logprobs",
            [](spec_session & s, int32_t last, const sampling_params & p, token_constraint * c) {
                py::gil_scoped_release release;
                constraint_scope scope(&s, c);
                token_logprobs lp;
                s.ar_step_sampled(last, p, &lp);
                return lp;
            },
            py::arg("last"), py::arg("sampling"), py::arg("constraint") = py::none(), "ar_step() that returns the token's TokenLogprobs");
}

void bind_spec(py::module_ & m) {
    m.attr("MAX_VERIFY") = k_max_block_size;  // most tokens one verify pass takes (chain or tree)
    bind_round_result(m);
    py::class_<spec_session> c(m, "Spec");
    c.def(py::init(&make_spec), py::arg("target"), py::arg("drafter"), py::arg("block_size") = 0,
          py::arg("ring_capacity") = 4096, py::arg("window") = 0, py::arg("draft_cutoff") = 0.0f,
          py::arg("draft_vocab") = true, py::arg("controller") = true, py::arg("tree_budget") = 0,
          py::keep_alive<1, 2>())
        .def_property("tree_budget", [](spec_session & s) { return s.params().tree_budget; },
                      &spec_session::set_tree_budget,
                      "Most nodes below the root a tree round verifies (round_tree, step_tree)")
        .def("round_tree", &spec_round_unforced<round_kind::round_tree>, py::arg("last"), py::arg("block_size"),
             py::arg("sampling") = py::none(),
            py::arg("constraint") = py::none(), "One tree round (fixed settings); with a Sampling, its sampled form")
        .def("step_tree", &spec_round_unforced<round_kind::step_tree>, py::arg("last"), py::arg("block_size"),
             py::arg("sampling") = py::none(),
            py::arg("constraint") = py::none(),
            "The next step in tree mode: the controller's AR step or a tree round; with a Sampling, their sampled forms")
        .def_property("controller", [](spec_session & s) { return s.params().use_controller; },
                      &spec_session::set_controller,
                      "Spec.step under the controller (True) or fixed settings (False)")
        .def_property("draft_cutoff", [](spec_session & s) { return s.params().draft_cutoff; },
                      &spec_session::set_draft_cutoff,
                      "Verify drafts only while the product of the drafter's top-1 probabilities >= this (0: all)")
        .def_property_readonly("block_size", &spec_session::block_size)
        .def_property_readonly("draft_vocab", [](spec_session & s) {
            return s.params().draft_vocab ? s.drafter_hparams_().draft_vocab : std::vector<int32_t>{};
        }, "Token ids the drafts are drawn from (the drafter GGUF's dflash.draft_vocab); empty: the whole vocabulary")
        .def_property("use_draft_vocab", [](spec_session & s) { return s.params().draft_vocab; }, &spec_session::set_draft_vocab,
                      "Draft over the drafter's draft vocabulary when it has one (False: the whole vocabulary)")
        .def_property_readonly("tap_layers", [](spec_session & s) { return s.drafter_hparams_().tap_layers; })
        .def_property_readonly("mask_token_id", [](spec_session & s) { return s.drafter_hparams_().mask_token_id; })
        .def_property_readonly("drafter_n_layer", [](spec_session & s) { return s.drafter_hparams_().n_layer; })
        .def_property_readonly("window", &spec_session::effective_window,
                               "Committed positions a draft attends to at most: drafter_window if given, else the "
                               "drafter's trained context, else the whole ring (and never more than the ring)")
        .def_property_readonly("trained_context_length", [](spec_session & s) { return s.drafter_hparams_().trained_context; },
                               "The drafter GGUF's dflash.trained_context_length (0: not recorded)")
        .def_property_readonly("ring_capacity", [](spec_session & s) { return s.ring().capacity; },
                               "Ring slots (feature_ring_capacity, cut to the window when one is set)");
    def_spec_drafting(c);
}

// The session hooks tests and benchmarks reach (forced rounds, given trees, drafter outputs, the
// controller's estimates): free functions of _core.testing taking the Target or Spec, so the
// classes hold only what the product path calls.
void bind_testing_sessions(py::module_ & t) {
    // Spec.round / step / round_tree / step_tree with `forced_draft` (B-1 tokens: acceptance-controlled
    // rounds) as the spec's draft override (spec.h: set_draft_override), checked at the step's start
    // whatever the controller chooses: a chain verifies it in place of the drafter's (which still
    // runs), a tree holds it at rank 0 of its positions
    const std::pair<const char *, round_result (*)(spec_session &, int32_t, int64_t, const py::object &,
                                                   const sampling_params *, token_constraint *)>
        forms[] = {{"round", &spec_round<round_kind::round>},
                   {"step", &spec_round<round_kind::step>},
                   {"round_tree", &spec_round<round_kind::round_tree>},
                   {"step_tree", &spec_round<round_kind::step_tree>}};
    for (const auto & [name, fn] : forms) {
        t.def(name, fn, py::arg("spec"), py::arg("last"), py::arg("block_size"), py::arg("forced_draft") = py::none(),
              py::arg("sampling") = py::none(), py::arg("constraint") = py::none(),
              "The Spec method of this name with forced_draft as the spec's draft override for this call");
    }
    t.def(
        "verify_tree",
        [](spec_session & s, const py::object & parents, const py::object & tokens, const sampling_params * sampling) {
            std::vector<int32_t> p = to_tokens(parents), tk = to_tokens(tokens);
            py::gil_scoped_release release;
            return s.verify_tree(p, tk, sampling);
        },
        py::arg("spec"), py::arg("parents"), py::arg("tokens"), py::arg("sampling") = py::none(),
        "Verify a given tree (tokens[0]: the last committed token) and commit its accepted path");
    t.def(
        "draft_logits",
        [](spec_session & s, int32_t last, int64_t B, const target_session & tg) {
            return to_array(drafting(B, [&] { return s.draft_logits(last, B); }), {B - 1, tg.hparams().n_vocab});
        },
        py::arg("spec"), py::arg("last"), py::arg("block_size"), py::arg("target"),
        "The drafter's logits for d_1..d_{B-1}, float32 [B-1, n_vocab]");
    t.def(
        "draft_lattice",
        [](spec_session & s, int32_t last, int64_t B) {
            return to_array(drafting(B, [&] { return s.draft_lattice(last, B); }),
                            {B - 1, s.drafter_hparams_().lattice_row()});
        },
        py::arg("spec"), py::arg("last"), py::arg("block_size"),
        "A DFlash 2 drafter's selector lattice for d_1..d_{B-1}, float32 [B-1, k + k*k]: per row the k "
        "candidate ids, then for each predecessor p the k transition scores (drafter.h: build_selector)");
    t.def(
        "draft_top1",
        [](spec_session & s, int32_t last, int64_t B) {
            std::vector<float> p;
            std::vector<int32_t> d = drafting(B, [&] { return s.draft_top1(last, B, p); });
            return py::make_tuple(d, p);
        },
        py::arg("spec"), py::arg("last"), py::arg("block_size"),
        "(drafts d_1..d_{B-1}, their probabilities) as the controller and draft_cutoff read them: the "
        "top-1 probability, DFlash 2's selector softmax, or DSpark's confidence head where the drafter has one");
    t.def(
        "draft_batch",
        [](const std::vector<spec_session *> & ss, const std::vector<int32_t> & lasts, int64_t B) {
            std::vector<shared_draft> out;
            {
                py::gil_scoped_release release;
                const std::vector<const sampling_params *> greedy(ss.size(), nullptr);
                spec_session::draft_batch(ss, lasts, greedy, std::vector<char>(ss.size(), 0), B, out);
            }
            py::list r;
            for (const shared_draft & d : out) r.append(py::make_tuple(d.tok, d.p));
            return r;
        },
        py::arg("specs"), py::arg("lasts"), py::arg("block_size"),
        "The scheduler's shared drafter pass over greedy blocks (spec.h: draft_batch), each spec on its own slot "
        "at a round under its controller: per spec (drafts d_1..d_{B-1}, their probabilities), draft_top1's alone");
    t.def("push_features", &spec_push_features, py::arg("spec"), py::arg("features"), py::arg("pos0"),
          "Push target features [m, n_taps, n_embd] of m committed positions from pos0 into the ring");
    t.def("controller_state", &controller_state, py::arg("spec"), "The controller's cost and rate estimates (a dict)");
    t.def(
        "target_verify_tree",
        [](target_session & s, const py::object & tokens, const py::object & parents, bool logits) -> py::object {
            std::vector<int32_t> toks = to_tokens(tokens), par = to_tokens(parents);
            if (par.size() != toks.size()) throw input_error(cat("[verify] ", toks.size(), " tokens but ", par.size(), " parents"));
            decode_result r;
            {
                py::gil_scoped_release release;
                r = s.verify_tree(toks.data(), par.data(), (int64_t) toks.size(), {}, !logits);
            }
            if (logits) return result_to_py(std::move(r), (int64_t) toks.size(), 0, s.hparams());
            return py::cast(r.argmax);
        },
        py::arg("target"), py::arg("tokens"), py::arg("parents"), py::arg("logits") = false,
        "Tree verify (what a tree round runs): tokens[i] is node i, parents[i] < i its parent (-1 for the root); "
        "returns the greedy token after each node (logits: every node's logits row instead). Follow with "
        "commit_tree(target, path).");
    t.def(
        "commit_tree",
        [](target_session & s, const py::object & path, int slot) {
            std::vector<int32_t> p = to_tokens(path);
            py::gil_scoped_release release;
            if (slot >= 0) s.select_slot(slot);
            s.commit_tree(p);
        },
        py::arg("target"), py::arg("path"), py::arg("slot") = -1,
        "Keep the accepted path (node indices from the root 0) of the pending tree verify (of sequence slot `slot` "
        "of a batch target, selecting it)");
    t.def(
        "baseline_target",
        [](const std::string & path, const std::string & rollback, const std::string & matmul, int64_t n_ctx,
           int n_threads, const std::string & kv_type, int64_t n_batch, const std::string & device, int64_t max_verify,
           bool use_mmap, int n_seq) {
            return make_target_slots(path, n_ctx, n_threads, kv_type, n_batch, device, max_verify, rollback, matmul,
                                     use_mmap, n_seq);
        },
        py::arg("path"), py::arg("rollback") = "tape", py::arg("matmul") = "own", py::arg("n_ctx") = 4096,
        py::arg("n_threads") = 0, py::arg("kv_type") = "f16", py::arg("n_batch") = 512, py::arg("device") = "cpu",
        py::arg("max_verify") = 0, py::arg("use_mmap") = true, py::arg("n_seq") = 1,
        "A Target on a benchmark baseline (Engine.for_benchmark): the GDN rollback strategy 'tape', 'snapshot' "
        "or 'redecode' (runtime/rollback.h), the matmul 'own' or 'ggml' (ggml_mul_mat everywhere)");
    t.def("n_graph_plans", &target_session::n_graph_plans, py::arg("target"),
          "Graph shapes holding a scheduler and allocation plan (see graph_runner.h)");
}

// ---- _core.testing: kernels, tape and caches as tests and benchmarks reach them -----------------

// A ggml type by its name ("q4_K", "Q8_0", "bf16": ggml_type_name, any case).
ggml_type ggml_type_named(const std::string & name) {
    auto lower = [](std::string v) {
        for (auto & ch : v) ch = (char) std::tolower((unsigned char) ch);
        return v;
    };
    for (int i = 0; i < GGML_TYPE_COUNT; ++i) {
        const ggml_type t = (ggml_type) i;
        if (ggml_blck_size(t) != 0 && lower(ggml_type_name(t)) == lower(name)) return t;
    }
    throw input_error(cat("[matmul] unknown ggml type '", name, "'"));
}

void bind_testing_kernels(py::module_ & t) {
    t.def(
        "matmul",
        [](py::array W, farr x, const std::string & isa, int n_threads, const std::string & type, bool f32_path) {
            // W [M, K] float16 or float32, or W [M, row bytes] uint8 holding rows of the ggml type `type`
            // (e.g. "q4_K", as gguf-py quantizes them); x [N, K] float32 -> y [N, M] float32 (matmul.h's
            // kernel; rows split over n_threads threads as the graph op splits them). f32_path: the
            // integer-path types through the dequantize-to-F32 path instead.
            DFN_REQUIRE(W.ndim() == 2 && x.ndim() == 2, "matmul", "W and x must be 2-D");
            DFN_REQUIRE(W.flags() & py::array::c_style, "matmul", "W must be C-contiguous");
            const int64_t M = W.shape(0), K = x.shape(1), N = x.shape(0);
            ggml_type wt = GGML_TYPE_F32;
            if (type.empty()) {
                const bool f16 = W.dtype().is(py::dtype("float16"));
                DFN_REQUIRE(f16 || W.dtype().is(py::dtype::of<float>()), "matmul", "W must be float16 or float32");
                wt = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
                DFN_REQUIRE(W.shape(1) == K, "matmul", "x has ", K, " columns, W has ", W.shape(1));
            } else {
                wt = ggml_type_named(type);
                DFN_REQUIRE(matmul_weight_type(wt), "matmul", "weight type ", type, " is not one the kernel takes");
                DFN_REQUIRE(W.dtype().is(py::dtype::of<uint8_t>()), "matmul", "W of type ", type, " must be uint8 bytes");
                DFN_REQUIRE(K % ggml_blck_size(wt) == 0 && (size_t) W.shape(1) == ggml_row_size(wt, K), "matmul", "W rows have ",
                            W.shape(1), " bytes; ", K, " columns of ", type, " need ",
                            K % ggml_blck_size(wt) == 0 ? cat(ggml_row_size(wt, K)) : cat("a multiple of ", ggml_blck_size(wt)));
            }
            DFN_REQUIRE(n_threads >= 1, "matmul", "n_threads must be >= 1");
            const size_t row_bytes = (size_t) W.strides(0);
            py::array_t<float> y({N, M});
            const void * w = W.data();
            const float * xp = x.data();
            float * yp = y.mutable_data();
            py::gil_scoped_release release;
            std::vector<std::thread> pool;
            std::vector<std::exception_ptr> errs((size_t) n_threads);
            for (int t = 1; t < n_threads; ++t) {
                pool.emplace_back([=, &errs] {
                    try {
                        matmul_rows(w, wt, row_bytes, xp, K, yp, M, K, N, M * t / n_threads, M * (t + 1) / n_threads, isa,
                                    f32_path);
                    } catch (...) {
                        errs[(size_t) t] = std::current_exception();
                    }
                });
            }
            try {
                matmul_rows(w, wt, row_bytes, xp, K, yp, M, K, N, 0, M / n_threads, isa, f32_path);
            } catch (...) {
                errs[0] = std::current_exception();
            }
            for (auto & th : pool) th.join();
            for (auto & e : errs) if (e) std::rethrow_exception(e);
            return y;
        },
        py::arg("W"), py::arg("x"), py::arg("isa") = "", py::arg("n_threads") = 1, py::arg("type") = "",
        py::arg("f32_path") = false);
    t.def(
        "ggml_vec_dot",
        [](py::array_t<uint8_t, py::array::c_style> W, farr x, const std::string & type) {
            // ggml's own one-column CPU path, for benchmarks beside matmul: x [N, K] quantized by the
            // type's vec_dot_type from_float, then y[n, r] = vec_dot(W row r, column n), one thread.
            ggml_cpu_init();  // ggml's CPU tables (idempotent)
            const ggml_type wt = ggml_type_named(type);
            const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(wt);
            DFN_REQUIRE(W.ndim() == 2 && x.ndim() == 2 && tr->vec_dot && ggml_is_quantized(wt), "ggml_vec_dot",
                        "W [M, row bytes] of a quantized type and x [N, K] needed");
            const int64_t M = W.shape(0), K = x.shape(1), N = x.shape(0);
            DFN_REQUIRE(K % ggml_blck_size(wt) == 0 && (size_t) W.shape(1) == ggml_row_size(wt, K), "ggml_vec_dot",
                        "W rows do not hold ", K, " values of ", type);
            const ggml_type vt = tr->vec_dot_type;
            const size_t qrow = ggml_row_size(vt, K);
            std::vector<uint8_t> xq((size_t) N * qrow);
            py::array_t<float> y({N, M});
            const uint8_t * w = W.data();
            const float * xp = x.data();
            float * yp = y.mutable_data();
            py::gil_scoped_release release;
            for (int64_t n = 0; n < N; ++n) ggml_get_type_traits_cpu(vt)->from_float(xp + n * K, xq.data() + n * qrow, K);
            for (int64_t n = 0; n < N; ++n)
                for (int64_t r = 0; r < M; ++r)
                    tr->vec_dot((int) K, yp + n * M + r, 0, w + r * W.shape(1), 0, xq.data() + n * qrow, 0, 1);
            return y;
        },
        py::arg("W"), py::arg("x"), py::arg("type"));
    t.def(
        "matmul_wide",
        [](py::array W, farr x, const std::string & type, const std::string & isa) {
            // W [M, row bytes] uint8 rows of Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K, x [N, K] float32 -> y [N, M] float32: the prompt
            // GEMM of wide_gemm.h (one thread) at isa "avx512f" / "avx2" / "" (the engine's)
            DFN_REQUIRE(W.ndim() == 2 && x.ndim() == 2 && (W.flags() & py::array::c_style), "matmul",
                        "W and x must be 2-D, W C-contiguous");
            DFN_REQUIRE(W.dtype().is(py::dtype::of<uint8_t>()), "matmul", "W must be uint8 bytes");
            const ggml_type wt = ggml_type_named(type);
            DFN_REQUIRE(q8_kind_of(wt) != q8_kind::none, "matmul", "the wide matmul takes Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K, not ",
                        ggml_type_name(wt));
            const int64_t M = W.shape(0), K = x.shape(1), N = x.shape(0);
            DFN_REQUIRE(K % ggml_blck_size(wt) == 0 && (size_t) W.shape(1) == ggml_row_size(wt, K), "matmul", "W rows have ",
                        W.shape(1), " bytes, not those of ", K, " columns of ", type);
            py::array_t<float> y({N, M});
            matmul_wide_rows(W.data(), wt, (size_t) W.strides(0), x.data(), K, y.mutable_data(), M, K, M, N, isa);
            return y;
        },
        py::arg("W"), py::arg("x"), py::arg("type"), py::arg("isa") = "");
    t.def(
        "moe_experts",
        [](py::array W, farr x, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
           const std::string & type, int n_threads) {
            // W [n_expert, M, K] float16 / float32, or [n_expert, M, row bytes] uint8 of the ggml type
            // `type`; x [n_tok, n_x, K] float32 (n_x 1 or n_used); ids [n_tok, n_used] int32 ->
            // y [n_tok, n_used, M] float32: the "moe_experts" op (moe_experts.h) alone in a ggml CPU
            // graph on n_threads threads.
            DFN_REQUIRE(W.ndim() == 3 && x.ndim() == 3 && ids.ndim() == 2, "moe_experts",
                        "W [n_expert, M, K or row bytes], x [n_tok, n_x, K] and ids [n_tok, n_used] needed");
            DFN_REQUIRE(W.flags() & py::array::c_style, "moe_experts", "W must be C-contiguous");
            const int64_t E = W.shape(0), M = W.shape(1), K = x.shape(2), T = x.shape(0), n_x = x.shape(1);
            const int64_t U = ids.shape(1);
            ggml_type wt = GGML_TYPE_F32;
            if (type.empty()) {
                const bool f16 = W.dtype().is(py::dtype("float16"));
                DFN_REQUIRE(f16 || W.dtype().is(py::dtype::of<float>()), "moe_experts", "W must be float16 or float32");
                wt = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
                DFN_REQUIRE(W.shape(2) == K, "moe_experts", "x has ", K, " values per column, W rows ", W.shape(2));
            } else {
                wt = ggml_type_named(type);
                DFN_REQUIRE(W.dtype().is(py::dtype::of<uint8_t>()), "moe_experts", "W of type ", type, " must be uint8 bytes");
                DFN_REQUIRE(K % ggml_blck_size(wt) == 0 && (size_t) W.shape(2) == ggml_row_size(wt, K), "moe_experts",
                            "W rows have ", W.shape(2), " bytes, not ", K, " values of ", type);
            }
            DFN_REQUIRE(ids.shape(0) == T && (n_x == 1 || n_x == U) && n_threads >= 1, "moe_experts",
                        "ids must be [n_tok, n_used] with x [n_tok, 1 or n_used, K], n_threads >= 1");
            const size_t bytes = (size_t) W.nbytes() + x.nbytes() + ids.nbytes() + (size_t) (T * U * M) * sizeof(float);
            ggml_init_params ip = {bytes + 4 * ggml_tensor_overhead() + ggml_graph_overhead() + (size_t(1) << 16), nullptr, false};
            ggml_context * ctx = ggml_init(ip);
            DFN_REQUIRE(ctx, "moe_experts", "ggml_init failed");
            std::unique_ptr<ggml_context, void (*)(ggml_context *)> hold(ctx, ggml_free);
            ggml_tensor * Wt = ggml_new_tensor_3d(ctx, wt, K, M, E);       // [K, M, n_expert]
            ggml_tensor * xt = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, n_x, T);  // F32 [K, n_x, n_tok]
            ggml_tensor * it = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, U, T);      // I32 [n_used, n_tok]
            std::memcpy(Wt->data, W.data(), ggml_nbytes(Wt));
            std::memcpy(xt->data, x.data(), ggml_nbytes(xt));
            std::memcpy(it->data, ids.data(), ggml_nbytes(it));
            DFN_REQUIRE(moe_experts_supported(Wt, xt, it), "moe_experts", "weight type ", ggml_type_name(wt),
                        " is not one the kernel takes");
            ggml_tensor * y = moe_experts_op(ctx, Wt, xt, it);                  // F32 [M, n_used, n_tok]
            ggml_cgraph * gf = ggml_new_graph(ctx);
            ggml_build_forward_expand(gf, y);
            {
                py::gil_scoped_release release;
                ggml_cpu_init();
                ggml_graph_compute_with_ctx(ctx, gf, n_threads);
            }
            throw_kernel_oom("moe_experts");
            py::array_t<float> out({T, U, M});
            std::memcpy(out.mutable_data(), y->data, ggml_nbytes(y));
            return out;
        },
        py::arg("W"), py::arg("x"), py::arg("ids"), py::arg("type") = "", py::arg("n_threads") = 1);
    t.def("matmul_wide_available", &matmul_wide_available,
          "True when prompt-sized Q4_0 / Q8_0 matmuls take the wide GEMM here (level AVX-512 with VNNI, or AVX2)");
    t.def("matmul_isa", [] { return std::string(matmul_isa()); }, "The instruction set the engine's matmul runs on");
    t.def("pretend_cpu_isa", [](const std::string & name) { testing_pretend_cpu_best(name); }, py::arg("name"),
          "Treat the CPU's best instruction set as `name` ('' undoes it): the ISA checks on a CPU that has every level");
    t.def("matmul_isas", &matmul_isas, "Instruction sets the matmul kernel can run on this machine");
    t.def("slow_matmul", &testing_slow_matmul, py::arg("level"), py::arg("seconds"),
          "Every engine matmul at `level` ('avx512f', 'avx2', 'portable') also spins `seconds` per call and "
          "thread (0 undoes it): tune_matmul must then choose another level");
    t.def(
        "top1",
        [](farr logits) {
            // logits [n, V] -> (argmax int64 [n], p float32 [n]) by top1.h's row kernel
            DFN_REQUIRE(logits.ndim() == 2 && logits.shape(1) >= 1, "top1", "logits must be 2-D with >= 1 column");
            const int64_t n = logits.shape(0), V = logits.shape(1);
            py::array_t<int64_t> arg(n);
            py::array_t<float> p(n);
            for (int64_t r = 0; r < n; ++r) top1_row(logits.data() + r * V, V, arg.mutable_data()[r], p.mutable_data()[r]);
            return py::make_tuple(arg, p);
        },
        py::arg("logits"));
    t.def(
        "topk",
        [](farr logits, int64_t K) {
            // logits [n, V] -> (index int64 [n, K], p float32 [n, K]) by top1.h's topk_row
            DFN_REQUIRE(logits.ndim() == 2 && logits.shape(1) >= 1 && K >= 1, "topk",
                        "logits must be 2-D with >= 1 column, K >= 1");
            const int64_t n = logits.shape(0), V = logits.shape(1);
            py::array_t<int64_t> idx({n, K});
            py::array_t<float> p({n, K});
            std::vector<float> row(2 * K);
            for (int64_t r = 0; r < n; ++r) {
                topk_row(logits.data() + r * V, V, K, row.data());
                for (int64_t k = 0; k < K; ++k) {
                    idx.mutable_data()[r * K + k] = (int64_t) row[2 * k];
                    p.mutable_data()[r * K + k] = row[2 * k + 1];
                }
            }
            return py::make_tuple(idx, p);
        },
        py::arg("logits"), py::arg("K"));
    t.def(
        "build_tree",
        [](int32_t root, const py::object & top_tok, farr top_p, int64_t budget, double min_score) {
            // top_tok, top_p [n_pos, K] -> (parents, tokens, depths, scores) of tree.h's build_tree
            std::vector<int32_t> tok = to_tokens(top_tok.attr("reshape")(-1));
            DFN_REQUIRE(top_p.ndim() == 2 && (int64_t) tok.size() == top_p.size(), "build_tree",
                        "top_tok and top_p must be [n_pos, K] alike");
            const draft_tree tr = build_tree(root, tok.data(), top_p.data(), top_p.shape(0), top_p.shape(1), budget,
                                             min_score);
            return py::make_tuple(tr.parent, tr.token, tr.depth, tr.score);
        },
        py::arg("root"), py::arg("top_tok"), py::arg("top_p"), py::arg("budget"), py::arg("min_score") = 0.0);
    t.def(
        "conv_silu",
        [](farr state, farr x, farr w) {
            // state [n_ch, d_conv-1], x [n_tok, n_ch], w [n_ch, d_conv] -> (out [n_tok, n_ch], new state):
            // conv.h's kernel, as a decode step runs it
            DFN_REQUIRE(state.ndim() == 2 && x.ndim() == 2 && w.ndim() == 2, "conv_silu", "state, x and w must be 2-D");
            const int64_t n_ch = w.shape(0), d_conv = w.shape(1), n_tok = x.shape(0);
            DFN_REQUIRE(d_conv >= 2 && state.shape(0) == n_ch && state.shape(1) == d_conv - 1 && x.shape(1) == n_ch,
                        "conv_silu", "shapes do not match: state [n_ch, d_conv-1], x [n_tok, n_ch], w [n_ch, d_conv]");
            py::array_t<float> st({n_ch, d_conv - 1}), out({n_tok, n_ch});
            std::memcpy(st.mutable_data(), state.data(), sizeof(float) * n_ch * (d_conv - 1));
            conv_silu_channels(st.mutable_data(), true, x.data(), n_ch, w.data(), out.mutable_data(), d_conv, n_ch, n_tok,
                               0, n_ch);
            return py::make_tuple(out, st);
        },
        py::arg("state"), py::arg("x"), py::arg("w"));
}

// A 1-D float32 logits array and optional token ids as the sampler's row (the arrays outlive it).
logits_row to_logits_row(const farr & logits, const std::optional<py::array_t<int32_t, py::array::c_style | py::array::forcecast>> & ids) {
    DFN_REQUIRE(logits.ndim() == 1 && logits.shape(0) >= 1, "sampling", "logits must be 1-D and non-empty");
    DFN_REQUIRE(!ids || (ids->ndim() == 1 && ids->shape(0) == logits.shape(0)), "sampling",
                "ids must be 1-D with one id per logit");
    return {logits.data(), logits.shape(0), ids ? ids->data() : nullptr};
}

void bind_testing_sampler(py::module_ & t) {
    using iarr = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
    t.def(
        "philox4x32_10",
        [](std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
            std::array<uint32_t, 4> out;
            philox4x32_10(ctr.data(), key.data(), out.data());
            return out;
        },
        py::arg("ctr"), py::arg("key"), "Philox4x32-10 of one counter under a key (sampler.h)");
    t.def(
        "gumbel",
        [](uint64_t seed, int64_t pos, iarr tokens) {
            py::array_t<double> g(tokens.size());
            for (py::ssize_t i = 0; i < tokens.size(); ++i) g.mutable_data()[i] = gumbel(seed, pos, tokens.data()[i]);
            return g;
        },
        py::arg("seed"), py::arg("pos"), py::arg("tokens"), "G(seed, pos, token) per token, float64");
    t.def(
        "noise_bits",
        [](uint64_t seed, int64_t pos, iarr tokens) {
            py::array_t<uint64_t> out(tokens.size());
            noise_bits_block(seed, pos, tokens.data(), tokens.size(), out.mutable_data());
            return out;
        },
        py::arg("seed"), py::arg("pos"), py::arg("tokens"),
        "noise_bits per token through the draw's vectorised block (the ISA in use), uint64");
    t.def(
        "sample",
        [](farr logits, const sampling_params & p, int64_t pos, std::optional<iarr> ids) {
            const sample_result r = sample_row(to_logits_row(logits, ids), p, pos, "sampling", true);
            return py::make_tuple(r.token, r.logprob);
        },
        py::arg("logits"), py::arg("sampling"), py::arg("pos"), py::arg("ids") = py::none(),
        "(token id, its log-probability under softmax(kept logits / T)): the sampler's draw at pos");
    t.def(
        "sample_filter",
        [](farr logits, const sampling_params & p) {
            return sampling_filter(to_logits_row(logits, std::nullopt), p, "sampling", 0);
        },
        py::arg("logits"), py::arg("sampling"), "Indices the filters keep, ascending");
    t.def(
        "sample_seeds",
        [](farr logits, const sampling_params & p, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> seeds,
           int64_t pos) {
            const logits_row row = to_logits_row(logits, std::nullopt);
            py::array_t<int32_t> out(seeds.size());
            sampling_params q = p;
            for (py::ssize_t i = 0; i < seeds.size(); ++i) {
                q.seed = seeds.data()[i];
                out.mutable_data()[i] = sample_row(row, q, pos, "sampling").token;
            }
            return out;
        },
        py::arg("logits"), py::arg("sampling"), py::arg("seeds"), py::arg("pos"),
        "The draw at pos for each seed (the sampling's own seed is ignored)");
}

void bind_testing_tape(py::module_ & t) {
    t.def(
        "gdn_tape_replay_inplace",
        [](py::array_t<float, py::array::c_style> state, farr tk, farr tu, farr tg, int64_t n, int n_threads) {
            const tape_dims d = check_replay_shapes(state, tk, tu, tg, n);
            float * st = state.mutable_data();
            py::gil_scoped_release release;
            gdn_tape_replay_mt(st, tape_view(tk, tu, tg), d.S, d.H_v, n, n_threads);
        },
        py::arg("state"), py::arg("tape_k"), py::arg("tape_u"), py::arg("tape_g"), py::arg("n"), py::arg("n_threads") = 1,
        "gdn_tape_replay writing into `state` (float32, C-contiguous, [H_v, S, S]) without copies.");
}

// The batched target (session.h: decode_batch) as the tests reach it: not on Target until the
// batch engine serves it.
void bind_testing_batch(py::module_ & t) {
    t.def(
        "batch_target",
        [](const std::string & path, int n_seq, int64_t n_ctx, int n_threads, const std::string & kv_type, int64_t n_batch,
           int64_t max_verify, const std::string & matmul, const std::string & device) {
            return make_target_slots(path, n_ctx, n_threads, kv_type, n_batch, device, max_verify, "tape", matmul, true, n_seq);
        },
        py::arg("path"), py::arg("n_seq"), py::arg("n_ctx") = 4096, py::arg("n_threads") = 0, py::arg("kv_type") = "f16",
        py::arg("n_batch") = 512, py::arg("max_verify") = 0, py::arg("matmul") = "own", py::arg("device") = "cpu",
        "A Target with n_seq sequence slots (slot 0 is the one its own methods serve)");
    t.def("n_seq", [](const target_session & s) { return s.n_seq(); }, py::arg("target"));
    // runtime/thread_governor.h: the CPU graphs' thread count, alone and a target's runner's
    py::class_<thread_governor>(t, "ThreadGovernor", "runtime/thread_governor.h alone")
        .def(py::init<int>(), py::arg("n_threads"))
        .def("threads", &thread_governor::threads, py::arg("now"))
        .def("observe", &thread_governor::observe, py::arg("threads"), py::arg("wall"), py::arg("cpu"), py::arg("now"))
        .def_property_readonly("current", &thread_governor::current)
        .def_property_readonly("reductions", &thread_governor::reductions)
        .def_property_readonly_static("k_probe", [](py::object) { return thread_governor::k_probe; })
        .def_property_readonly_static("k_probe_min_s", [](py::object) { return thread_governor::k_probe_min_s; })
        .def_property_readonly_static("k_probe_max_s", [](py::object) { return thread_governor::k_probe_max_s; });
    t.def(
        "runner_threads",
        [](target_session & s) {
            py::dict d;
            d["asked"] = s.runner().n_threads();
            d["now"] = s.runner().threads_now();
            d["reductions"] = s.runner().thread_reductions();
            return d;
        },
        py::arg("target"), "The target's runner: threads asked, threads its CPU graphs run on now, reductions");
    t.def(
        "set_threads",
        [](target_session & s, int n) {
            if (n < 0 || n > s.runner().n_threads())
                throw input_error(cat("[engine] threads must be in [0, ", s.runner().n_threads(), "], got ", n));
            s.runner().set_threads_override(n);
        },
        py::arg("target"), py::arg("n"), "Every CPU graph of the target's runner on n threads (0: the governor's)");
    t.def(
        "decode_batch",
        [](target_session & s, const py::list & work, const std::vector<int> & taps) {
            std::vector<batch_item> items;
            for (const py::handle & h : work) {
                const py::tuple w = py::cast<py::tuple>(h);
                if (w.size() != 3 && w.size() != 4)
                    throw input_error("[batch] each item is (slot, tokens, kind) or (slot, tokens, 'tree', parents)");
                batch_item it;
                it.slot = py::cast<int>(w[0]);
                it.tokens = to_tokens(py::reinterpret_borrow<py::object>(w[1]));
                const std::string kind = py::cast<std::string>(w[2]);
                if (kind == "prefill") it.kind = BATCH_PREFILL;
                else if (kind == "decode") it.kind = BATCH_DECODE;
                else if (kind == "verify" || kind == "tree") it.kind = BATCH_VERIFY;
                else throw input_error(cat("[batch] kind must be 'prefill', 'decode', 'verify' or 'tree', got '", kind, "'"));
                if ((kind == "tree") != (w.size() == 4)) throw input_error("[batch] a 'tree' item, and only one, takes parents");
                if (kind == "tree") it.parents = py::cast<std::vector<int32_t>>(w[3]);
                items.push_back(std::move(it));
            }
            std::vector<decode_result> res;
            {
                py::gil_scoped_release release;
                res = s.decode_batch(items, taps);
            }
            py::list out;
            for (size_t i = 0; i < res.size(); ++i) {
                out.append(result_to_py(std::move(res[i]), (int64_t) items[i].tokens.size(), taps.size(), s.hparams()));
            }
            return out;
        },
        py::arg("target"), py::arg("work"), py::arg("taps") = std::vector<int>{},
        "One target pass over several slots' work [(slot, tokens, 'prefill' | 'decode' | 'verify') or (slot, tokens, "
        "'tree', parents)]: per item what decode() / verify() / verify_tree() of it alone returns (prefill: no logit "
        "rows; decode: the last row; verify and tree: all rows, pending until commit_slot / commit_tree_slot)");
    t.def(
        "commit_slot",
        [](target_session & s, int slot, int64_t n_keep) {
            py::gil_scoped_release release;
            s.commit_slot(slot, n_keep);
        },
        py::arg("target"), py::arg("slot"), py::arg("n_keep"));
    t.def("reset_slot", &target_session::reset_slot, py::arg("target"), py::arg("slot"));
    t.def("slot_n_past", &target_session::slot_n_past, py::arg("target"), py::arg("slot"));
    // engine/batch_controller.h: the batch's controller, alone (its decisions from made-up
    // measurements) and a scheduler's (its parameters)
    auto params_of = [](bool enabled, int64_t ar_every, int64_t ar_run, int64_t settle_steps, int64_t probe_steps,
                        int64_t backoff_min, int64_t backoff_max, int64_t spec_window, int64_t ar_window, double margin) {
        batch_controller_params p;
        if (!(margin >= 1.0 && margin <= 4.0)) throw input_error(cat("[batch] margin must be in [1, 4], got ", margin));
        p.margin = margin;
        p.enabled = enabled, p.ar_every = ar_every, p.ar_run = ar_run, p.settle_steps = settle_steps;
        p.probe_steps = probe_steps;
        p.backoff_min = backoff_min, p.backoff_max = backoff_max, p.spec_window = spec_window, p.ar_window = ar_window;
        for (int64_t v : {ar_every, probe_steps, backoff_min, backoff_max, spec_window, ar_window})
            if (v < 1) throw input_error(cat("[batch] controller parameters must be >= 1, got ", v));
        if (settle_steps < 0 || ar_run <= settle_steps)
            throw input_error(cat("[batch] ar_run must be > settle_steps >= 0 (a run's first settle_steps AR steps are "
                                  "not measured), got ar_run ", ar_run, ", settle_steps ", settle_steps));
        return p;
    };
    const batch_controller_params d;
#define DFN_BATCH_CONTROLLER_ARGS                                                                                  \
    py::arg("enabled") = d.enabled, py::arg("ar_every") = d.ar_every, py::arg("ar_run") = d.ar_run,                \
        py::arg("settle_steps") = d.settle_steps, py::arg("probe_steps") = d.probe_steps,                          \
        py::arg("backoff_min") = d.backoff_min, py::arg("backoff_max") = d.backoff_max,                            \
        py::arg("spec_window") = d.spec_window, py::arg("ar_window") = d.ar_window, py::arg("margin") = d.margin
    py::class_<batch_controller>(t, "BatchController", "engine/batch_controller.h alone")
        .def(py::init([params_of](int max_requests, bool enabled, int64_t ar_every, int64_t ar_run, int64_t settle_steps,
                                  int64_t probe_steps, int64_t backoff_min, int64_t backoff_max, int64_t spec_window,
                                  int64_t ar_window, double margin) {
                 return std::make_unique<batch_controller>(
                     max_requests, params_of(enabled, ar_every, ar_run, settle_steps, probe_steps, backoff_min,
                                             backoff_max, spec_window, ar_window, margin));
             }),
             py::arg("max_requests"), DFN_BATCH_CONTROLLER_ARGS)
        .def("speculate", &batch_controller::speculate, py::arg("n"))
        .def("observe", &batch_controller::observe, py::arg("n"), py::arg("speculated"), py::arg("tokens"),
             py::arg("seconds"), py::arg("n_stepping") = 0)
        .def("rate", &batch_controller::rate, py::arg("n"), py::arg("speculated"))
        .def_static("width_class", &batch_controller::width_class, py::arg("n"))
        .def_property_readonly("switches", &batch_controller::switches)
        .def_property_readonly("forced_ar_steps", &batch_controller::forced_ar_steps);
    t.def(
        "batch_controller_params",
        [params_of](scheduler & s, bool enabled, int64_t ar_every, int64_t ar_run, int64_t settle_steps,
                    int64_t probe_steps, int64_t backoff_min, int64_t backoff_max, int64_t spec_window, int64_t ar_window,
                    double margin) {
            s.batch_control().set_params(params_of(enabled, ar_every, ar_run, settle_steps, probe_steps, backoff_min,
                                                   backoff_max, spec_window, ar_window, margin));
        },
        py::arg("scheduler"), DFN_BATCH_CONTROLLER_ARGS, "Sets the scheduler's batch controller (no request in flight)");
#undef DFN_BATCH_CONTROLLER_ARGS
    t.def(
        "batch_controller_rates",
        [](scheduler & s, int n) {
            const batch_controller & c = s.batch_control();
            return py::make_tuple(c.rate(n, true), c.rate(n, false), c.speculate(n));
        },
        py::arg("scheduler"), py::arg("n"),
        "(speculative rate, all-AR rate, whether the next step may speculate) of the scheduler's batch controller "
        "at n requests: committed tokens per request per second over each mode's window");


}

void bind_testing_caches(py::module_ & t) {
    t.def(
        "check_placement", [](target_session & s, bool on) { s.runner().set_check_placement(on); },
        py::arg("target"), py::arg("on") = true,
        "Record every graph node the scheduler places on the CPU backend of a device engine (placement())");
    t.def(
        "placement", [](target_session & s) { return s.runner().placement(); }, py::arg("target"),
        "'<graph> <op> <node name>' per node a device engine ran on the CPU backend since check_placement");
    t.def(
        "kv",
        [](target_session & s, int il, int slot) {
            const auto & hp = s.hparams();
            if (il < 0 || il >= hp.n_layer || hp.layer_is_gdn(il)) throw input_error(cat("[cache] layer ", il, " has no K/V"));
            const kv_layer & c = s.slot_cache(slot).kv[il];
            const int64_t n = s.slot_n_past(slot);
            auto k = to_array(read_tensor_f32(c.k, n), {n, hp.n_head_kv, hp.head_dim});
            auto v = to_array(read_tensor_f32(c.v, n), {n, hp.n_head_kv, hp.head_dim});
            return py::make_tuple(k, v);
        },
        py::arg("target"), py::arg("layer"), py::arg("slot") = 0,
        "Cached K and V of an attention layer (of sequence slot `slot`), float32 [n_past, n_head_kv, head_dim] each");
    t.def(
        "gdn_state",
        [](target_session & s, int il, int slot) {
            const auto & hp = s.hparams();
            if (il < 0 || il >= hp.n_layer || !hp.layer_is_gdn(il)) throw input_error(cat("[cache] layer ", il, " is not a GDN layer"));
            const gdn_layer & c = s.slot_cache(slot).gdn[il];
            const int64_t S = hp.ssm_head_dim;
            // ggml stores S^T per head (k index fastest): numpy [H_v, v, k] -> transpose to [H_v, k, v] in Python
            auto ssm = to_array(read_tensor_f32(c.ssm), {hp.ssm_n_v_heads, S, S});
            auto conv = to_array(read_tensor_f32(c.conv), {hp.ssm_conv_channels(), hp.ssm_d_conv - 1});
            return py::make_tuple(ssm, conv);
        },
        py::arg("target"), py::arg("layer"), py::arg("slot") = 0,
        "GDN state of a layer (of sequence slot `slot`): (ssm float32 [n_v_heads, d_v, d_k] i.e. S^T per head, conv float32 [channels, d_conv-1])");
    t.def(
        "ring_kv",
        [](spec_session & s, int il) {
            feature_ring & r = s.ring();
            if (il < 0 || il >= (int) r.k.size()) throw input_error(cat("[feature_ring] no drafter layer ", il));
            const ggml_tensor * k = r.k[il];
            auto kk = to_array(read_tensor_f32(k, r.capacity), {r.capacity, k->ne[1], k->ne[0]});
            auto vv = to_array(read_tensor_f32(r.v[il], r.capacity), {r.capacity, k->ne[1], k->ne[0]});
            return py::make_tuple(kk, vv);
        },
        py::arg("spec"), py::arg("layer"), "Ring K, V of a drafter layer by slot, float32 [capacity, n_head_kv, head_dim]");
    t.def(
        "ring_slot_positions",
        [](spec_session & s) {
            std::vector<int64_t> out;
            for (int64_t i = 0; i < s.ring().capacity; ++i) out.push_back(s.ring().slot_position(i));
            return out;
        },
        py::arg("spec"), "The position each ring slot holds (-1: empty)");
    t.def(
        "controller_fixed_costs",
        [](spec_session & s, double t_ar, double t_draft, double v0, double v1) {
            s.control().set_fixed_costs(t_ar, t_draft, v0, v1);
        },
        py::arg("spec"), py::arg("ar_s"), py::arg("draft_s"), py::arg("verify0_s"), py::arg("verify1_s"),
        "The controller prices steps by these costs instead of measuring them (a verify of n tokens: "
        "verify0_s + verify1_s * n), so its decisions depend only on acceptance");
    t.def(
        "controller_synthetic_costs",
        [](spec_session & s, double t_ar, double t_draft, double v0, double v1, double spike_s, double spike_p,
           uint64_t seed) { s.control().set_synthetic_costs(t_ar, t_draft, v0, v1, spike_s, spike_p, seed); },
        py::arg("spec"), py::arg("ar_s"), py::arg("draft_s"), py::arg("verify0_s"), py::arg("verify1_s"),
        py::arg("spike_s"), py::arg("spike_p"), py::arg("seed") = 0,
        "A busy machine, made up: each step's measured time becomes these costs (as controller_fixed_costs) "
        "plus, with probability spike_p (a seeded draw per step), spike_s seconds; the controller estimates "
        "its costs from these times as from measured ones");
}

py::object stop_reason_of(const request & r) {
    switch (r.stats().stop) {
        case stop_reason::eos: return py::str("eos");
        case stop_reason::length: return py::str("length");
        case stop_reason::context: return py::str("context");
        case stop_reason::caller: return py::str("stop");
        default: return py::none();
    }
}

py::dict stats_of(const request & r) {
    const request_stats & s = r.stats();
    py::dict d;
    d["n_prompt_tokens"] = s.n_prompt;
    d["n_cached_tokens"] = s.n_cached;
    d["prefill_s"] = s.prefill_s;
    d["decode_s"] = s.decode_s;
    d["ar_steps"] = s.ar_steps;
    d["acceptance_histogram"] = s.histogram;
    d["rounds"] = s.rounds();
    d["draft_s"] = s.draft_s;
    d["verify_s"] = s.verify_s;
    d["rollback_s"] = s.rollback_s;
    d["verified_tokens"] = s.verified_tokens;
    d["controller_switches"] = s.controller_switches;
    d["drafter_failure"] = s.drafter_failure;
    d["slot"] = r.slot();  // the sequence slot it ran on (a scheduler's; 0 on a one-slot engine)
    return d;
}

request_policy policy_of(bool speculative, bool tree, const sampling_params * sampling, int64_t max_tokens,
                         bool exact_max_tokens, token_constraint * constraint) {
    request_policy p;
    p.speculative = speculative;
    p.tree = tree;
    if (sampling) p.sampling = *sampling;
    p.max_tokens = max_tokens;
    p.exact_max_tokens = exact_max_tokens;
    p.constraint = constraint;
    return p;
}

// _core.Request: engine/request.h, the one request loop (engine.py's _Run is its text layer).
void bind_request(py::module_ & m) {
    py::class_<request>(m, "Request", "One request's loop: prefill, then AR steps or rounds until a token-level "
                                      "stop (engine/request.h)")
        .def(py::init([](target_session & t, spec_session * s, const tokenizer * vocab, bool speculative, bool tree,
                         const sampling_params * sampling, int64_t max_tokens, bool exact_max_tokens,
                         token_constraint * constraint) {
                 return std::make_unique<request>(t, s, vocab, policy_of(speculative, tree, sampling, max_tokens,
                                                                          exact_max_tokens, constraint));
             }),
             py::arg("target"), py::arg("spec"), py::arg("vocab"), py::arg("speculative"), py::arg("tree") = false,
             py::arg("sampling") = py::none(), py::arg("max_tokens") = 0, py::arg("exact_max_tokens") = false,
             py::arg("constraint") = py::none(), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<1, 4>(),
             py::keep_alive<1, 10>())
        .def(
            "start",
            [](request & r, const py::object & prompt, int64_t n_cached) {
                std::vector<int32_t> t = to_tokens(prompt);
                py::gil_scoped_release release;
                request::emitted e = r.start(t.data(), (int64_t) t.size(), n_cached);
                return std::make_pair(std::move(e.tokens), std::move(e.logprobs));
            },
            py::arg("prompt"), py::arg("n_cached") = 0,
            "The prefill; (tokens emitted, their TokenLogprobs when asked for). n_cached: the leading prompt tokens "
            "the target (and ring) already hold")
        .def(
            "step",
            [](request & r) {
                py::gil_scoped_release release;
                request::emitted e = r.step();
                return std::make_pair(std::move(e.tokens), std::move(e.logprobs));
            },
            "One AR step or round: (tokens emitted, their TokenLogprobs when asked for)")
        .def("stop", &request::stop, "End the request (a stop string, a cancellation)")
        .def_property_readonly("done", &request::done)
        .def_property_readonly("stop_reason", &stop_reason_of)
        .def("set_draft_source", &request::set_draft_source, py::arg("source"),
             "Tests, benchmarks: f(output tokens, B) -> the B-1 drafts to verify instead of the drafter's "
             "(which still runs), or [] for the drafter's")
        .def_property_readonly("block_size", &request::block_size)
        .def_property_readonly("output", &request::output)
        .def_property_readonly("committed", &request::committed,
                               "Every token the target committed, past a stop too (it has run all but the last)")
        .def_property_readonly("ring_in_step", &request::ring_in_step)
        .def_property_readonly("stats", &stats_of, "The request's statistics (request_stats) as a dict of GenerationStats' fields");
}

// _core.Scheduler: engine/scheduler.h, the engine over several sequence slots; each request a Ticket.
void bind_scheduler(py::module_ & m) {
    using ticket_ptr = std::shared_ptr<scheduler::ticket>;
    struct py_ticket {
        scheduler * s;
        ticket_ptr t;
        const request & done_request() const {
            const request * r = s->result(*t);
            if (!r) throw input_error("[generate] the request has not ended");
            return *r;
        }
    };
    py::class_<scheduler>(m, "Scheduler", "Requests over a target's sequence slots, batched per step (engine/scheduler.h)")
        .def(py::init([](target_session & t, spec_session * spec0, const tokenizer * vocab) {
                 return std::make_unique<scheduler>(t, spec0, vocab);
             }),
             py::arg("target"), py::arg("spec"), py::arg("vocab"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
             py::keep_alive<1, 4>())
        .def(
            "submit",
            [](scheduler & s, const py::object & prompt, bool speculative, bool tree, const sampling_params * sampling,
               int64_t max_tokens, bool exact_max_tokens, token_constraint * constraint, bool cache_prompt,
               std::optional<request::draft_source> source) {
                std::vector<int32_t> toks = to_tokens(prompt);
                return py_ticket{&s, s.submit(std::move(toks), policy_of(speculative, tree, sampling, max_tokens,
                                                                         exact_max_tokens, constraint),
                                              cache_prompt, source ? *source : request::draft_source{})};
            },
            py::arg("prompt"), py::arg("speculative"), py::arg("tree") = false, py::arg("sampling") = py::none(),
            py::arg("max_tokens") = 0, py::arg("exact_max_tokens") = false, py::arg("constraint") = py::none(),
            py::arg("cache_prompt") = false, py::arg("draft_source") = py::none(), py::keep_alive<0, 1>(),
            py::keep_alive<0, 8>(), "Queues a request; its Ticket")
        .def_property_readonly("n_slots", &scheduler::n_slots)
        .def("forget_held", &scheduler::forget_held, "Drop every slot's prompt cache (Engine.eval runs on the target)")
        .def("spec", &scheduler::spec, py::arg("slot"), py::return_value_policy::reference_internal)
        .def_property_readonly("pass_stats", [](const scheduler & s) {
            const scheduler::pass_stats p = s.stats();
            py::dict d;
            d["passes"] = p.passes;
            d["tokens"] = p.tokens;
            d["solo_steps"] = p.solo_steps;
            d["shared_drafts"] = p.shared_drafts;
            d["batch_ar_steps"] = p.batch_ar_steps;
            d["batch_switches"] = p.batch_switches;
            d["batched_prefills"] = p.batched_prefills;
            d["prefill_chunks"] = p.prefill_chunks;
            d["tree_verifies"] = p.tree_verifies;
            d["steps"] = p.steps;
            d["step_s"] = p.step_s;
            d["width"] = p.width;
            return d;
        }, "Batched target passes: count, tokens, solo steps, and passes by the number of requests in them");
    py::class_<py_ticket>(m, "Ticket", "One request in a Scheduler")
        .def(
            "next",
            [](py_ticket & t) {
                request::emitted e;
                {
                    py::gil_scoped_release release;
                    e = t.s->next(*t.t);
                }
                return std::make_pair(std::move(e.tokens), std::move(e.logprobs));
            },
            "The tokens emitted since the last call (and their TokenLogprobs when asked for), waiting (and "
            "stepping the engine) until there are some or the request has ended")
        .def("stop", [](py_ticket & t) { t.s->cancel(*t.t); }, "End the request at the next step")
        .def_property_readonly("done", [](const py_ticket & t) { return t.s->done(*t.t); })
        .def_property_readonly("slot", [](const py_ticket & t) { return t.s->slot_of(*t.t); },
                               "The sequence slot it runs in (-1 while it queues)")
        .def_property_readonly("stop_reason", [](const py_ticket & t) { return stop_reason_of(t.done_request()); })
        .def_property_readonly("stats", [](const py_ticket & t) { return stats_of(t.done_request()); })
        .def_property_readonly("committed", [](const py_ticket & t) { return t.done_request().committed(); })
        .def_property_readonly("ring_in_step", [](const py_ticket & t) { return t.done_request().ring_in_step(); })
        .def_property_readonly("block_size", [](const py_ticket & t) { return t.done_request().block_size(); });
}

}  // namespace

void bind_tokenizer(py::module_ & m);  // bindings_embed.cpp

PYBIND11_MODULE(_core, m) {
    m.doc() = "dflash-native C++ core over ggml";
    bind_module_info(m);
    bind_verify(m);
    bind_tape(m);
    bind_sampling(m);
    bind_constraint(m);
    bind_target(m);
    bind_spec(m);
    bind_tokenizer(m);
    bind_request(m);
    bind_scheduler(m);
    py::module_ t = m.def_submodule("testing", "Kernels, tape and cache inspection for tests and benchmarks");
    bind_testing_kernels(t);
    bind_testing_sampler(t);
    bind_testing_tape(t);
    bind_testing_caches(t);
    bind_testing_batch(t);
    bind_testing_sessions(t);
}
