#include "runtime/devices.h"

#include "base/common.h"

#include <algorithm>
#if !defined(_WIN32)
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#endif
#include <cctype>
#include <cstdio>
#include <mutex>

namespace dfn {

namespace {

std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    return s;
}

const char * type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "igpu";
        default: return "accel";
    }
}

ggml_backend_reg_t rpc_reg() { return ggml_backend_reg_by_name("RPC"); }

const char * k_build_hint =
    "Rebuild llama-cpp-python with the backend (e.g. CMAKE_ARGS=\"-DGGML_CUDA=on -DGGML_RPC=on\" pip install "
    "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36), then reinstall dflash-native "
    "(pip install --no-build-isolation .)";

// True when a TCP connection to host:port opens. ggml-rpc aborts the process when it cannot
// connect, so every endpoint is tried here first.
bool can_connect(const std::string & host, const std::string & port) {
#if defined(_WIN32)
    return true;
#else
    addrinfo hints{}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return false;
    bool ok = false;
    for (addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
#endif
}

// True when a TCP socket can be bound to host:port and listen (then closed again).
bool can_listen(const std::string & host, const std::string & port) {
#if defined(_WIN32)
    return true;
#else
    addrinfo hints{}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return false;
    bool ok = false;
    for (addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        const int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as ggml's server sets it
        ok = bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1) == 0;
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
#endif
}

// Adds the RPC server at `endpoint` (host:port) once per process; returns its first device.
ggml_backend_dev_t add_rpc_server(const std::string & endpoint) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    ggml_backend_reg_t reg = rpc_reg();
    DFN_REQUIRE(reg != nullptr, "engine", "device 'rpc://", endpoint, "': the ggml in use has no RPC backend. ",
                k_build_hint);
    using add_fn = ggml_backend_reg_t (*)(const char *);
    auto add = (add_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server");
    DFN_REQUIRE(add != nullptr, "engine", "the ggml RPC backend has no ggml_backend_rpc_add_server");
    const size_t colon = endpoint.rfind(':');
    DFN_REQUIRE(colon != std::string::npos && colon > 0 && colon + 1 < endpoint.size(), "engine", "device 'rpc://",
                endpoint, "': expected rpc://HOST:PORT");
    const std::string port = endpoint.substr(colon + 1);
    DFN_REQUIRE(std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); }) &&
                    std::stol(port) > 0 && std::stol(port) < 65536,
                "engine", "device 'rpc://", endpoint, "': the port must be 1..65535");
    // the first time only: ggml-rpc keeps one connection per endpoint for the process, and a
    // server busy with it would leave a probe in its accept queue
    static std::vector<std::string> added;
    if (std::find(added.begin(), added.end(), endpoint) == added.end()) {
        DFN_REQUIRE(can_connect(endpoint.substr(0, colon), port), "engine", "cannot reach the RPC server at ", endpoint,
                    " (start one with `dflash-native rpc-server --host H --port P`)");
    }
    ggml_backend_reg_t srv = add(endpoint.c_str());
    DFN_REQUIRE(srv != nullptr && ggml_backend_reg_dev_count(srv) > 0, "engine", "cannot reach the RPC server at ",
                endpoint, " (start one with `dflash-native rpc-server --host H --port P`)",
                last_ggml_error().empty() ? "" : ": ", last_ggml_error());
    if (std::find(added.begin(), added.end(), endpoint) == added.end()) added.push_back(endpoint);
    for (size_t i = 0; i < ggml_backend_reg_dev_count(srv); ++i) {
        ggml_backend_dev_t d = ggml_backend_reg_dev_get(srv, i);
        bool known = false;
        for (size_t j = 0; j < ggml_backend_dev_count(); ++j) known = known || ggml_backend_dev_get(j) == d;
        if (!known) ggml_backend_device_register(d);
    }
    return ggml_backend_reg_dev_get(srv, 0);
}

}  // namespace

bool rpc_available() { return rpc_reg() != nullptr; }

ggml_backend_dev_t local_gpu() {
    // ggml lists an RPC server's devices as GPUs: "gpu" means one of this machine's
    for (enum ggml_backend_dev_type type : {GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU}) {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(d) == type && (rpc_reg() == nullptr || ggml_backend_dev_backend_reg(d) != rpc_reg()))
                return d;
        }
    }
    return nullptr;
}

std::vector<device_info> list_devices() {
    std::vector<device_info> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        device_info info;
        info.name = ggml_backend_dev_name(d);
        info.description = ggml_backend_dev_description(d);
        info.type = type_name(ggml_backend_dev_type(d));
        ggml_backend_dev_memory(d, &info.memory_free, &info.memory_total);
        out.push_back(info);
    }
    return out;
}

ggml_backend_dev_t resolve_device(const std::string & spec) {
    const std::string s = lower(spec);
    if (s == "cpu") return nullptr;
    if (s.rfind("rpc://", 0) == 0) {
        const std::string rest = spec.substr(6);
        DFN_REQUIRE(rest.find(',') == std::string::npos, "engine", "device '", spec,
                    "' names several RPC servers: one device wanted here");
        return add_rpc_server(rest);
    }
    if (s == "gpu") {
        ggml_backend_dev_t d = local_gpu();
        DFN_REQUIRE(d != nullptr, "engine", "device='gpu' asked for, but the ggml this package runs on has no GPU "
                    "backend. ", k_build_hint);
        return d;
    }
    std::string names;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (lower(ggml_backend_dev_name(d)) == s) {
            return ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU ? nullptr : d;
        }
        names += cat(names.empty() ? "" : ", ", ggml_backend_dev_name(d));
    }
    throw input_error(cat("[engine] no device '", spec, "': this ggml has ", names,
                          " (or use 'cpu', 'gpu', 'rpc://HOST:PORT'). ", k_build_hint));
}

std::vector<ggml_backend_dev_t> resolve_devices(const std::string & spec) {
    std::vector<ggml_backend_dev_t> out;
    if (lower(spec).rfind("rpc://", 0) == 0) {
        const std::string rest = spec.substr(6);
        size_t b = 0;
        for (;;) {
            const size_t e = rest.find(',', b);
            const std::string one = rest.substr(b, e == std::string::npos ? std::string::npos : e - b);
            DFN_REQUIRE(!one.empty(), "engine", "device '", spec, "': an empty server in the list");
            ggml_backend_dev_t d = add_rpc_server(one);
            DFN_REQUIRE(std::find(out.begin(), out.end(), d) == out.end(), "engine", "device '", spec, "' names ", one,
                        " twice");
            out.push_back(d);
            if (e == std::string::npos) break;
            b = e + 1;
        }
        return out;
    }
    if (ggml_backend_dev_t d = resolve_device(spec)) out.push_back(d);
    return out;
}

void rpc_serve(const std::string & host, int port, const std::string & device, int n_threads,
               const std::string & cache_dir) {
    ggml_backend_reg_t reg = rpc_reg();
    DFN_REQUIRE(reg != nullptr, "rpc-server", "the ggml in use has no RPC backend. ", k_build_hint);
    DFN_REQUIRE(port > 0 && port < 65536, "rpc-server", "port must be 1..65535, got ", port);
    DFN_REQUIRE(!host.empty(), "rpc-server", "empty host");
    DFN_REQUIRE(lower(device).rfind("rpc://", 0) != 0, "rpc-server", "a server cannot serve another RPC server");
    ggml_backend_dev_t dev = resolve_device(device);
    if (dev == nullptr) dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    DFN_REQUIRE(dev != nullptr, "rpc-server", "no CPU device");
    using start_fn = void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *);
    auto start = (start_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_start_server");
    DFN_REQUIRE(start != nullptr, "rpc-server", "the ggml RPC backend has no ggml_backend_rpc_start_server");
    const std::string endpoint = cat(host, ":", port);
    // ggml's server prints its failures and returns: a port that cannot be listened on is ours to say
    DFN_REQUIRE(can_listen(host, std::to_string(port)), "rpc-server", "cannot listen on ", endpoint,
                " (an address of this machine, and a port no other process holds?)");
    // one line a caller (a test, a launcher) can wait for, before the call that blocks
    std::printf("dflash-native rpc-server: serving %s on %s\n", ggml_backend_dev_name(dev), endpoint.c_str());
    std::fflush(stdout);
    start(endpoint.c_str(), cache_dir.empty() ? nullptr : cache_dir.c_str(), (size_t) std::max(1, n_threads), 1, &dev);
    throw runtime_error(cat("[rpc-server] the RPC server on ", endpoint, " stopped (ggml's message above says why)"));
}

}  // namespace dfn
