// pybind11 module dflash_native._core: the only file that knows about Python.
#include "common.h"
#include "session.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using namespace dfn;

namespace {

ggml_type parse_kv_type(const std::string & s) {
    if (s == "f16") return GGML_TYPE_F16;
    if (s == "f32") return GGML_TYPE_F32;
    throw input_error(cat("[engine] kv_type must be 'f16' or 'f32', got '", s, "'"));
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

template <typename T>
py::array_t<float> to_array(std::vector<float> && v, std::vector<py::ssize_t> shape) {
    auto * heap = new std::vector<float>(std::move(v));
    py::capsule owner(heap, [](void * p) { delete static_cast<std::vector<float> *>(p); });
    return py::array_t<float>(shape, heap->data(), owner);  // zero-copy: the array owns the vector
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "dflash-native C++ core over ggml";

    m.def("ggml_version", [] { return std::string(ggml_version()); });
    m.def("gpu_available", [] { return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr; },
          "True when the ggml this package runs on has a GPU backend (CUDA, Metal, ...)");

    py::class_<target_session>(m, "Target")
        .def(py::init([](const std::string & path, int64_t n_ctx, int n_threads, const std::string & kv_type,
                         int64_t n_batch, const std::string & device) {
                 session_params p;
                 p.n_ctx = n_ctx;
                 p.n_threads = n_threads;
                 p.kv_type = parse_kv_type(kv_type);
                 p.n_batch = n_batch;
                 p.device = device;
                 py::gil_scoped_release release;
                 return std::make_unique<target_session>(path, p);
             }),
             py::arg("path"), py::arg("n_ctx") = 4096, py::arg("n_threads") = 0, py::arg("kv_type") = "f16",
             py::arg("n_batch") = 512, py::arg("device") = "cpu")
        .def_property_readonly("arch", [](const target_session & s) { return s.hparams().arch; })
        .def_property_readonly("n_vocab", [](const target_session & s) { return s.hparams().n_vocab; })
        .def_property_readonly("n_embd", [](const target_session & s) { return s.hparams().n_embd; })
        .def_property_readonly("n_layer", [](const target_session & s) { return s.hparams().n_layer; })
        .def_property_readonly("n_ctx", [](const target_session & s) { return s.params().n_ctx; })
        .def_property_readonly("n_threads", [](const target_session & s) { return s.params().n_threads; })
        .def_property_readonly("n_past", &target_session::n_past)
        .def_property_readonly("device", &target_session::device_name)
        .def_property_readonly("layer_types", [](const target_session & s) {
            std::vector<std::string> out;
            for (int il = 0; il < s.hparams().n_layer; ++il) out.push_back(s.hparams().layer_is_gdn(il) ? "gdn" : "attention");
            return out;
        })
        .def_property_readonly("weights_bytes", [](const target_session & s) { return s.model().file().weights_bytes(); })
        .def_property_readonly("cache_bytes", [](target_session & s) { return s.cache().bytes(); })
        .def("reset", &target_session::reset, "Empty the sequence: n_past = 0, GDN state zeroed")
        .def(
            "decode",
            [](target_session & s, const py::object & tokens, bool all_logits, const std::vector<int> & taps) -> py::object {
                std::vector<int32_t> toks = to_tokens(tokens);
                decode_result r;
                {
                    py::gil_scoped_release release;
                    r = s.decode(toks.data(), (int64_t) toks.size(), all_logits, taps);
                }
                const int64_t n_vocab = s.hparams().n_vocab;
                py::array_t<float> logits = to_array<float>(std::move(r.logits), {r.n_rows, n_vocab});
                if (taps.empty()) return logits;
                py::array_t<float> t = to_array<float>(std::move(r.taps),
                    {(py::ssize_t) toks.size(), (py::ssize_t) taps.size(), (py::ssize_t) s.hparams().n_embd});
                return py::make_tuple(logits, t);
            },
            py::arg("tokens"), py::arg("all_logits") = false, py::arg("taps") = std::vector<int>{},
            "Run tokens at positions n_past.. and append them to the cache. Returns logits float32 "
            "[n_rows, n_vocab] (all tokens or the last), and with taps=[layers] also the hidden states "
            "after those layers, float32 [n_tokens, n_taps, n_embd].")
        .def(
            "kv",
            [](target_session & s, int il) {
                const auto & hp = s.hparams();
                if (il < 0 || il >= hp.n_layer || hp.layer_is_gdn(il)) throw input_error(cat("[cache] layer ", il, " has no K/V"));
                const kv_layer & c = s.cache().kv[il];
                const int64_t n = s.n_past();
                auto k = to_array<float>(s.read_tensor_f32(c.k, n), {n, hp.n_head_kv, hp.head_dim});
                auto v = to_array<float>(s.read_tensor_f32(c.v, n), {n, hp.n_head_kv, hp.head_dim});
                return py::make_tuple(k, v);
            },
            py::arg("layer"), "Cached K and V of an attention layer, float32 [n_past, n_head_kv, head_dim] each")
        .def(
            "gdn_state",
            [](target_session & s, int il) {
                const auto & hp = s.hparams();
                if (il < 0 || il >= hp.n_layer || !hp.layer_is_gdn(il)) throw input_error(cat("[cache] layer ", il, " is not a GDN layer"));
                const gdn_layer & c = s.cache().gdn[il];
                const int64_t S = hp.ssm_head_dim;
                // ggml stores S^T per head (k index fastest): numpy [H_v, v, k] -> transpose to [H_v, k, v] in Python
                auto ssm = to_array<float>(s.read_tensor_f32(c.ssm), {hp.ssm_n_v_heads, S, S});
                auto conv = to_array<float>(s.read_tensor_f32(c.conv), {hp.ssm_conv_channels(), hp.ssm_d_conv - 1});
                return py::make_tuple(ssm, conv);
            },
            py::arg("layer"),
            "GDN state of a layer: (ssm float32 [n_v_heads, d_v, d_k] i.e. S^T per head, conv float32 [channels, d_conv-1])");
}
