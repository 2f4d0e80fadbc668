// ggml's devices as dflash-native names them: listing, resolving a device string, and serving this
// machine's backends over ggml's RPC protocol. docs/architecture.md, "Devices".
#pragma once

#include "ggml-backend.h"

#include <cstddef>
#include <string>
#include <vector>

namespace dfn {

struct device_info {
    std::string name;         // ggml's device name: "CPU", "CUDA0", "Vulkan0", "RPC0[127.0.0.1:50052]"
    std::string description;  // the backend's description of it
    std::string type;         // "cpu", "gpu", "igpu", "accel"
    size_t memory_free = 0, memory_total = 0;
};

// Every device ggml has registered (after any RPC servers this process added).
std::vector<device_info> list_devices();

// The device an Engine's `device` string names (input_error when there is none):
//   "cpu"              ggml's CPU backend (the package's own batch-invariant kernels)
//   "gpu"              local_gpu(): this machine's first GPU device (not an RPC server's)
//   "CUDA0", ...       a ggml device by name (case-insensitive)
//   "rpc://H:P"        a ggml RPC server (`dflash-native rpc-server`): its first device
// nullptr means the CPU.
ggml_backend_dev_t resolve_device(const std::string & spec);
// The same, with "rpc://H1:P1,H2:P2,..." naming several servers: one device each, in order (a
// model split by layers over them). Empty: the CPU.
std::vector<ggml_backend_dev_t> resolve_devices(const std::string & spec);

// True when the ggml in use has the RPC backend (built with GGML_RPC=ON).
bool rpc_available();

// This machine's first GPU (else integrated GPU) device, never an RPC server's; nullptr: none.
ggml_backend_dev_t local_gpu();

// Serves `device` (a resolve_device string; "cpu": the CPU backend on n_threads) over ggml's RPC
// protocol on host:port until the process ends. Blocks. input_error on a bad device or address.
void rpc_serve(const std::string & host, int port, const std::string & device, int n_threads,
               const std::string & cache_dir);

}  // namespace dfn
