// overlap._C: every export of the extension, in one place.
//
// Addresses and streams are plain integers (tensor.data_ptr(), stream.cuda_stream).
// std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError (pybind11's
// default translations).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>

#include "launchers.h"

namespace py = pybind11;

namespace {

// Host waits run with the GIL released, in slices of at most this long; between slices
// they take the GIL back to let Ctrl-C through (PyErr_CheckSignals), so a rank stuck
// waiting for a dead peer can still be interrupted before its deadline.
constexpr auto kWaitSlice = std::chrono::milliseconds(100);

// Calls slice(slice_end) until done(result) or the deadline; returns the last result.
// The slices check their addresses and throw with the GIL released; the guard takes it
// back during unwinding, before pybind11 translates the exception.
template <class Slice, class Done>
auto wait_released(double timeout_s, Slice slice, Done done) {
  const auto deadline = overlap::deadline_after(timeout_s);
  for (;;) {
    const auto slice_end = std::min(deadline, overlap::Clock::now() + kWaitSlice);
    decltype(slice(slice_end)) result;
    {
      py::gil_scoped_release nogil;
      result = slice(slice_end);
    }
    if (done(result) || slice_end >= deadline) return result;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

bool signal_wait(uint64_t addr, int64_t value, double timeout_s) {
  const int32_t v = overlap::check_int32(value, "value");
  return wait_released(
      timeout_s, [&](overlap::Clock::time_point end) { return overlap::signal_wait_until(addr, v, end); },
      [](bool ok) { return ok; });
}

int64_t signal_wait_all(const std::vector<uint64_t>& addrs, int64_t value, double timeout_s) {
  const int32_t v = overlap::check_int32(value, "value");
  return wait_released(
      timeout_s,
      [&](overlap::Clock::time_point end) { return overlap::signal_wait_all_until(addrs, v, end); },
      [](int64_t missing) { return missing == -1; });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "overlap's native signals: host flags with acquire/release ordering and deadlines; "
            "CUDA stream-ordered and device-side flag waits.";

#ifdef OVERLAP_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif

  // ---- host flags: int32 words at `addr`, in memory shared between processes ----
  m.def("signal_store", &overlap::signal_store, py::arg("addr"), py::arg("value"),
        "Store `value` (int32) at `addr` with release ordering.");
  m.def("signal_load", &overlap::signal_load, py::arg("addr"),
        "Load the int32 at `addr` with acquire ordering.");
  m.def("signal_add", &overlap::signal_add, py::arg("addr"), py::arg("value"),
        "Atomically add `value` to the int32 at `addr` (acq_rel); return the old value.");
  m.def("signal_wait", &signal_wait, py::arg("addr"), py::arg("value"), py::arg("timeout_s"),
        "Wait until *(int32*)addr >= value (modulo 2^32: the signed difference is >= 0): True once it holds, False if `timeout_s` "
        "seconds pass first. Releases the GIL; yields the core while waiting.");
  m.def("signal_wait_all", &signal_wait_all, py::arg("addrs"), py::arg("value"),
        py::arg("timeout_s"),
        "Wait until every *(int32*)addrs[i] >= value within one deadline of `timeout_s` "
        "seconds. Return -1 on success, else the index of the first flag still below value. "
        "Releases the GIL.");

  // ---- CUDA: raise RuntimeError without the CUDA half or without a usable device ----
  m.def("cuda_device_count", &overlap::cuda_device_count,
        "Number of usable CUDA devices; 0 without a driver, a GPU or the CUDA half.");
  m.def("cuda_stream_write_value32", &overlap::cuda_stream_write_value32, py::arg("addr"),
        py::arg("value"), py::arg("stream"),
        "Enqueue on `stream` a write of `value` to the device-visible int32 at `addr`, "
        "after a fence over the work enqueued before it.");
  m.def("cuda_stream_wait_value32", &overlap::cuda_stream_wait_value32, py::arg("addr"),
        py::arg("value"), py::arg("stream"),
        "Make work enqueued on `stream` after this wait until *(int32*)addr >= value "
        "(the driver's cyclic GEQ).");
  m.def("cuda_wait_flag_bounded", &overlap::cuda_wait_flag_bounded, py::arg("addr"),
        py::arg("value"), py::arg("timeout_ns"), py::arg("err_addr"), py::arg("stream"),
        "Enqueue on `stream` a one-thread kernel that waits until *(int32*)addr >= value; "
        "if `timeout_ns` pass first it sets *(int32*)err_addr to 1 (when 0) and exits.");

  m.def("cuda_host_register", &overlap::cuda_host_register, py::arg("addr"), py::arg("nbytes"), py::arg("device"),
        "Register the host memory [addr, addr + nbytes) (page-aligned, e.g. a mapped shared-memory segment) "
        "as page-locked, mapped and portable (cudaHostRegister, with `device` current); return its device address, which "
        "cuda_stream_wait_value32 / cuda_stream_write_value32 and kernels take.");
  m.def("cuda_host_unregister", &overlap::cuda_host_unregister, py::arg("addr"),
        "Undo cuda_host_register(addr, ...) (cudaHostUnregister).");

  // ---- the host watchdog of stream-ordered waits (host code: every build) ----
  m.def("watchdog_arm", &overlap::watchdog_arm, py::arg("word_addr"), py::arg("value"), py::arg("timeout_s"),
        py::arg("err_addr"), py::arg("abort_addr"), py::arg("peer"),
        "Bound a stream-ordered wait on the host int32 at `word_addr` (>= value): if it has not reached "
        "`value` after `timeout_s` seconds, a host thread sets *err_addr to 1 and *abort_addr to peer + 1 "
        "(each only when 0), then raises the word to `value`, which releases the waiting stream.");
  m.def("watchdog_pending", &overlap::watchdog_pending,
        "Armed watchdog entries whose word has not yet reached its value.");
  m.def("watchdog_fired", &overlap::watchdog_fired, "How many entries the watchdog has released (since import).");
  m.def("watchdog_cancel", &overlap::watchdog_cancel, py::arg("addr"), py::arg("nbytes"),
        "Drop every armed entry whose word, error or abort address lies in [addr, addr + nbytes) "
        "(before that memory is unmapped or reset); return how many.");

  // ---- CUDA: MoE all-to-all within a node (overlap/ops/moe_cuda.py builds the tables) ----
  m.def("moe_dispatch_rows", &overlap::moe_dispatch_rows, py::arg("src_rows"), py::arg("row_index"),
        py::arg("num_sends"), py::arg("row_bytes"), py::arg("dst_table"), py::arg("block_offsets"),
        py::arg("chunk_offsets"), py::arg("num_blocks"), py::arg("groups_per_dest"), py::arg("num_chunks"),
        py::arg("rows_per_chunk"), py::arg("counters"), py::arg("flag_addrs"), py::arg("epoch"),
        py::arg("stream"),
        "Enqueue on `stream` the copy of send position p's row (source row row_index[p], row_bytes "
        "bytes, a multiple of 16) into region dst_table[d] at row p - block_offsets[d*G] for each of "
        "`num_sends` positions, one CTA per chunk of rows_per_chunk rows of a (destination, expert "
        "group) block; the block's last CTA stores `epoch` into *(int32*)flag_addrs[block] with a "
        "system-scope release. `counters` (int32 [num_blocks]) must be zero and is left at zero.");
  m.def("moe_combine_rows", &overlap::moe_combine_rows, py::arg("back_table"), py::arg("send_offsets"),
        py::arg("world_size"), py::arg("pos"), py::arg("weights"), py::arg("out"), py::arg("num_tokens"),
        py::arg("top_k"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"),
        "Enqueue on `stream` out[t] = sum_k weights[t, k] * row(t, k) (fp32, k in order, one cast), "
        "row(t, k) being row pos[t*K+k] - send_offsets[d] of region back_table[d] (d: the destination "
        "whose send positions hold pos[t*K+k]). dtype: 0 float32, 1 bfloat16, 2 float16 (rows and "
        "out); weights float32 [T, K]. Does not wait on flags: the caller's stream has waited.");
}
