// _core.Tokenizer (tokenizer.h for Python: dflash_native/_tokenizer.py wraps it) and where the core
// library this module runs on lies (dflash_native.get_library_dir). Part of the pybind11 module
// (bindings.cpp calls bind_tokenizer), kept apart to keep that file's areas apart.
#include "base/common.h"
#include "dflash_native.h"
#include "gguf/quantize.h"
#include "gguf/tokenizer.h"

#include <dlfcn.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using namespace dfn;

void bind_tokenizer(py::module_ & m) {
    py::class_<tokenizer>(m, "Tokenizer", "llama.cpp's vocabulary of a GGUF (csrc/gguf/tokenizer.h)")
        .def_static(
            "load",
            [](const std::string & path) {
                py::gil_scoped_release release;
                return tokenizer::load(path);
            },
            py::arg("path"),
            "The file's vocabulary, or None when it has none; ValueError when it is broken (vocab.h)")
        .def_property_readonly("n_vocab", &tokenizer::n_vocab)
        .def_property_readonly("bos_token_id", &tokenizer::bos)
        .def_property_readonly("eos_token_id", &tokenizer::eos)
        .def_property_readonly("chat_template", [](const tokenizer & t) -> py::object {
            if (!t.has_chat_template()) return py::none();
            const std::string & v = t.chat_template();
            return py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(v.data(), (py::ssize_t) v.size(), "replace"));
        })
        .def(
            "tokenize",
            [](const tokenizer & t, const std::string & text, bool add_special, bool parse_special) {
                py::gil_scoped_release release;
                return t.tokenize(text, add_special, parse_special);
            },
            py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = true,
            "Token ids of UTF-8 text (a str is encoded as UTF-8)")
        .def(
            "piece", [](const tokenizer & t, int32_t token) { return py::bytes(t.piece(token)); }, py::arg("token"),
            "The bytes of one token")
        .def("is_eog", &tokenizer::is_eog, py::arg("token"))
        .def("is_control", &tokenizer::is_control, py::arg("token"));

    // The file libdflash_native was loaded from (the library the C API's users link): dladdr of one
    // of its functions, so the answer holds in an installed package and in a build tree alike.
    m.def("library_path", [] {
        Dl_info info{};
        if (!dladdr(reinterpret_cast<void *>(&dfn_version), &info) || !info.dli_fname)
            throw dfn::runtime_error("[library_path] dladdr cannot tell where libdflash_native was loaded from");
        return std::string(info.dli_fname);
    }, "Path of the libdflash_native shared library this module runs on");
    m.def(
        "quantize",
        [](const std::string & src, const std::string & dst, int ftype, int n_threads, py::function on_log) {
            // llama.cpp logs from the calling thread: each line goes to on_log(level, bytes) with the
            // GIL taken back; an exception in on_log is dropped (it must not cross llama.cpp's frames)
            auto call = [&on_log](int level, const char * text) {
                py::gil_scoped_acquire gil;
                try {
                    on_log(level, py::bytes(text));
                } catch (py::error_already_set & e) {
                    e.discard_as_unraisable("dflash_native quantize log callback");
                }
            };
            py::gil_scoped_release release;
            return quantize_gguf(src, dst, ftype, n_threads, call);
        },
        py::arg("src"), py::arg("dst"), py::arg("ftype"), py::arg("n_threads"), py::arg("on_log"),
        "llama_model_quantize (csrc/gguf/quantize.h): 0 on success; on_log(level, line bytes) gets llama.cpp's log");
    m.def("c_api_version", [] { return std::string(dfn_version()); }, "dfn_version() of the C API");
}
