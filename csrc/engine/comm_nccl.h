// The NCCL communicator's entry points: plain C++ (no CUDA or NCCL headers), so the binding includes this in every
// build. With FASTGPT_WITH_NCCL, comm_nccl.cu defines them; without it the inline versions below throw, so that
// asking a CPU-only or NCCL-less build for NCCL fails with an instruction rather than a link error.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/comm.h"

namespace fastgpt {

#ifdef FASTGPT_WITH_NCCL

// 128-byte ncclUniqueId as a std::string of raw bytes; rank 0 makes it, the launcher's channel carries it.
std::string nccl_unique_id();
// A communicator for `rank` of `world` ranks on CUDA device `device` (the caller's model's device).
std::shared_ptr<Comm> make_nccl_comm(const std::string& unique_id, int rank, int world, int device);
bool built_with_nccl();

#else

namespace detail {
[[noreturn]] inline void no_nccl() {
  throw std::runtime_error(
      "fastgpt was built without NCCL: multi-GPU training needs it. Install NCCL (e.g. pip install "
      "nvidia-nccl-cu13, or set NCCL_ROOT to an NCCL install) and reinstall fastgpt with the CUDA engine");
}
}  // namespace detail

inline std::string nccl_unique_id() { detail::no_nccl(); }
inline std::shared_ptr<Comm> make_nccl_comm(const std::string&, int, int, int) { detail::no_nccl(); }
inline bool built_with_nccl() { return false; }

#endif

}  // namespace fastgpt
