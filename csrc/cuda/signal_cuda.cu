// CUDA launchers for flags: stream-ordered 32-bit write and wait (copy-engine pipelines
// need no SM for them) and a one-thread kernel that waits with a clock-based limit.
//
// There is no libcuda to link against at build time, and _C must import on machines
// without a driver: the CUDA runtime is linked statically, and the three driver calls
// are looked up at first use with cudaGetDriverEntryPointByVersion (cudaGetDriverEntryPoint
// is deprecated in CUDA 13). Every launcher first checks that a device is usable.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <sstream>
#include <stdexcept>
#include <string>

#include "../launchers.h"
#include "overlap/cuda_signal.cuh"

namespace overlap {
namespace {

// Throws unless this process can use a CUDA device. With no driver or no GPU the static
// runtime returns an error here (no crash), which becomes the RuntimeError's message.
void require_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it, so later runtime calls do not report it again
    throw std::runtime_error(cat("overlap._C: no usable CUDA device (cudaGetDeviceCount: ",
                                 cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    throw std::runtime_error(
        "overlap._C: no usable CUDA device (cudaGetDeviceCount: 0 devices)");
  }
}

// The ABI version of each driver symbol is pinned (12000 selects the newest version
// introduced up to CUDA 12.0), so the pointer types below stay right whatever the driver.
constexpr unsigned int kDriverApiVersion = 12000;

template <class Fn>
Fn driver_entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &fn, kDriverApiVersion, cudaEnableDefault, &status);
  if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    throw std::runtime_error(cat("overlap._C: cannot get CUDA driver entry point ", symbol,
                                 " (", cudaGetErrorString(e), ", query status ",
                                 static_cast<int>(status), ")"));
  }
  return reinterpret_cast<Fn>(fn);
}

struct DriverApi {
  PFN_cuStreamWriteValue32_v11070 write_value32;
  PFN_cuStreamWaitValue32_v11070 wait_value32;
  PFN_cuGetErrorString_v6000 get_error_string;
};

// Resolved once, at first use (not at import). If resolving throws, the next call retries.
const DriverApi& driver() {
  static const DriverApi api{
      driver_entry_point<PFN_cuStreamWriteValue32_v11070>("cuStreamWriteValue32"),
      driver_entry_point<PFN_cuStreamWaitValue32_v11070>("cuStreamWaitValue32"),
      driver_entry_point<PFN_cuGetErrorString_v6000>("cuGetErrorString"),
  };
  return api;
}

void check_cu(CUresult r, const char* what, uint64_t addr, int32_t value, uint64_t stream) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().get_error_string(r, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown error";
  throw std::runtime_error(cat("overlap._C: ", what, " failed: ", msg, " (CUresult ",
                               static_cast<int>(r), "; addr=0x", std::hex, addr, std::dec,
                               ", value=", value, ", stream=0x", std::hex, stream, ")"));
}

__global__ void wait_flag_bounded_kernel(const int32_t* flag, int32_t value,
                                         uint64_t timeout_ns, int32_t* err) {
  cuda::wait_flag_geq_bounded(flag, value, timeout_ns, err);
}

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// Checks the arguments, then enqueues one stream memory operation (write or wait) on `stream`.
// `op` names the driver entry point; it is looked up only after the device check.
template <class StreamOp>
void stream_value_op(StreamOp DriverApi::*op, const char* name, uint64_t addr, int64_t value, uint64_t stream,
                     unsigned int flags) {
  require_device();
  check_flag_address(addr, "addr");
  const int32_t v = check_int32(value, "value");
  check_cu((driver().*op)(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr),
                          static_cast<cuuint32_t>(v), flags),
           name, addr, v, stream);
}

// The write is stream-ordered and, with the default flags, preceded by a memory fence
// scoped to the stream: work enqueued before it is visible to whoever sees the value
// (a release). `addr` must be device memory or host memory mapped for the device.
void cuda_stream_write_value32(uint64_t addr, int64_t value, uint64_t stream) {
  stream_value_op(&DriverApi::write_value32, "cuStreamWriteValue32", addr, value, stream,
                  CU_STREAM_WRITE_VALUE_DEFAULT);
}

// Work enqueued after the wait starts once (int32_t)(*addr - value) >= 0: the driver's
// GEQ is a cyclic compare, equal to a signed >= while flags (epochs) stay within 2^31 of
// each other. This wait has no limit of its own: where a deadline is needed, overlap
// enqueues cuda_wait_flag_bounded instead.
void cuda_stream_wait_value32(uint64_t addr, int64_t value, uint64_t stream) {
  stream_value_op(&DriverApi::wait_value32, "cuStreamWaitValue32", addr, value, stream, CU_STREAM_WAIT_VALUE_GEQ);
}

// One thread spins until *addr >= value or timeout_ns pass; on timeout it sets *err_addr
// to 1 (kErrWaitTimeout) if it was 0. The launch goes to the current device.
void cuda_wait_flag_bounded(uint64_t addr, int64_t value, int64_t timeout_ns, uint64_t err_addr,
                            uint64_t stream) {
  require_device();
  const int32_t* flag = check_flag_address(addr, "addr");
  int32_t* err = check_flag_address(err_addr, "err_addr");
  const int32_t v = check_int32(value, "value");
  if (timeout_ns < 0) {
    throw std::invalid_argument(cat("overlap._C: timeout_ns must be >= 0, got timeout_ns=",
                                    timeout_ns));
  }
  wait_flag_bounded_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      flag, v, static_cast<uint64_t>(timeout_ns), err);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(cat("overlap._C: launching the bounded flag wait failed: ",
                                 cudaGetErrorString(e), " (addr=0x", std::hex, addr,
                                 ", stream=0x", stream, ")"));
  }
}

namespace {
void check_rt(cudaError_t e, const char* what, uint64_t addr) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(cat("overlap._C: ", what, " failed: ", cudaGetErrorString(e), " (addr=0x", std::hex,
                               addr, ")"));
}
}  // namespace

// The control pads (POSIX shared memory every local rank maps) become flags the device reads and
// writes: stream memory operations take device pointers, and registered host memory has one
// (cudaHostGetDevicePointer). Mapped + portable: usable from every context of this process.
uint64_t cuda_host_register(uint64_t addr, int64_t nbytes, int64_t device) {
  require_device();
  check_flag_address(addr, "addr");
  if (nbytes <= 0) {
    throw std::invalid_argument(cat("overlap._C: nbytes must be > 0, got nbytes=", nbytes));
  }
  int count = 0;
  check_rt(cudaGetDeviceCount(&count), "cudaGetDeviceCount", addr);
  if (device < 0 || device >= count) {
    throw std::invalid_argument(cat("overlap._C: device must be in [0, ", count, "), got device=", device));
  }
  // This extension's (static) runtime keeps its own current device: make it the caller's, so that the
  // registration uses that device's primary context (torch's) instead of creating one on device 0.
  check_rt(cudaSetDevice(static_cast<int>(device)), "cudaSetDevice", addr);
  int supported = 0;
  check_rt(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterSupported, static_cast<int>(device)),
           "cudaDeviceGetAttribute(cudaDevAttrHostRegisterSupported)", addr);
  if (!supported) {
    throw std::runtime_error(cat("overlap._C: device ", device, " cannot register host memory "
                                 "(cudaDevAttrHostRegisterSupported = 0)"));
  }
  void* host = reinterpret_cast<void*>(addr);
  check_rt(cudaHostRegister(host, static_cast<size_t>(nbytes), cudaHostRegisterMapped | cudaHostRegisterPortable),
           "cudaHostRegister", addr);
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) {
    cudaHostUnregister(host);
    check_rt(e, "cudaHostGetDevicePointer", addr);
  }
  return reinterpret_cast<uint64_t>(dev);
}

void cuda_host_unregister(uint64_t addr) {
  require_device();
  check_rt(cudaHostUnregister(reinterpret_cast<void*>(addr)), "cudaHostUnregister", addr);
}

}  // namespace overlap
