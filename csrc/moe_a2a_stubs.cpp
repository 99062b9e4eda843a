// The MoE all-to-all exports of a build without the CUDA half: they exist and say why they
// cannot work (the launchers are csrc/cuda/moe_a2a.cu). Empty where the CUDA half is built.
#include <stdexcept>

#include "launchers.h"

namespace overlap {

#ifndef OVERLAP_WITH_CUDA
namespace {
#ifdef OVERLAP_CUDA_DISABLED  // CMake: nvcc was there, but OVERLAP_BUILD_CUDA=0
constexpr const char* kNoCudaReason = "OVERLAP_BUILD_CUDA=0 at build time";
#else
constexpr const char* kNoCudaReason = "nvcc not found at build time";
#endif

[[noreturn]] void no_cuda(const char* op) {
  throw std::runtime_error(cat("overlap._C.", op, ": overlap._C was built without CUDA (", kNoCudaReason, ")"));
}
}  // namespace

void moe_dispatch_rows(uint64_t, uint64_t, int64_t, int64_t, uint64_t, uint64_t, uint64_t, int64_t, int64_t,
                       int64_t, int64_t, uint64_t, uint64_t, int64_t, uint64_t) {
  no_cuda("moe_dispatch_rows");
}
void moe_combine_rows(uint64_t, uint64_t, int64_t, uint64_t, uint64_t, uint64_t, int64_t, int64_t, int64_t,
                      int64_t, uint64_t) {
  no_cuda("moe_combine_rows");
}
#endif

}  // namespace overlap
