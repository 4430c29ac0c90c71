// The NCCL communicator: data-parallel collectives between CUDA devices, queued on the model's stream so that they
// are ordered after the kernels that produce their inputs without any host synchronisation. A side stream lets the
// gradient all-reduce of one bucket overlap the backward of the next (all_reduce_async / finish).
//
// Every buffer is reduced in place, using NCCL's in-place conventions (reduce-scatter: recvbuff = sendbuff +
// rank*recvcount; all-gather: sendbuff = recvbuff + rank*sendcount), so no staging copy is ever made.
// After any failure the communicator is aborted rather than destroyed on teardown: ncclCommDestroy may wait for
// peers that are gone, ncclCommAbort does not.
#ifdef FASTGPT_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <stdexcept>
#include <thread>

#include "cuda/check.h"
#include "cuda/runtime.h"
#include "engine/comm_nccl.h"

namespace fastgpt {

namespace {

class NcclComm final : public Comm {
 public:
  NcclComm(const std::string& unique_id, int rank, int world, int device) : rank_(rank), world_(world), device_(device) {
    if (unique_id.size() != sizeof(ncclUniqueId))
      throw std::invalid_argument("unique_id: expected the " + std::to_string(sizeof(ncclUniqueId)) +
                                  " bytes of nccl_unique_id(), got " + std::to_string(unique_id.size()));
    if (world < 1) throw std::invalid_argument("world=" + std::to_string(world) + ": must be at least 1");
    if (rank < 0 || rank >= world)
      throw std::invalid_argument("rank=" + std::to_string(rank) + ": must be in [0, world=" + std::to_string(world) + ")");
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (device < 0 || device >= count)
      throw std::invalid_argument("device=" + std::to_string(device) + ": no such CUDA device (" +
                                  std::to_string(count) + " visible)");
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    // The destructor does not run for a half-built object, so undo whatever was made before a failure here.
    try {
      const cuda::DeviceGuard guard(device_);
      FASTGPT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      FASTGPT_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      FASTGPT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
      FASTGPT_NCCL_CHECK(ncclCommInitRank(&comm_, world, id, rank));
    } catch (...) {
      failed_ = true;
      teardown();
      throw;
    }
    model_ = side_;  // until a model binds its stream
  }
  ~NcclComm() override { teardown(); }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "nccl"; }
  void use_stream(void* stream) override { model_ = stream ? static_cast<cudaStream_t>(stream) : side_; }

  void all_reduce(float* x, int64_t n, bool average) override {
    guarded([&] {
      FASTGPT_NCCL_CHECK(ncclAllReduce(x, x, n, ncclFloat, average ? ncclAvg : ncclSum, comm_, model_));
    });
  }
  void reduce_scatter(float* x, int64_t shard, bool average) override {
    guarded([&] {
      FASTGPT_NCCL_CHECK(ncclReduceScatter(x, x + rank_ * shard, shard, ncclFloat, average ? ncclAvg : ncclSum,
                                           comm_, model_));
    });
  }
  void all_gather(void* x, int64_t shard_bytes) override {
    guarded([&] {
      char* base = static_cast<char*>(x);
      FASTGPT_NCCL_CHECK(ncclAllGather(base + rank_ * shard_bytes, base, shard_bytes, ncclInt8, comm_, model_));
    });
  }
  void broadcast(void* x, int64_t bytes, int root) override {
    if (root < 0 || root >= world_)
      throw std::invalid_argument("root=" + std::to_string(root) + ": must be in [0, " + std::to_string(world_) + ")");
    guarded([&] { FASTGPT_NCCL_CHECK(ncclBroadcast(x, x, bytes, ncclInt8, root, comm_, model_)); });
  }
  void all_reduce_host(double* x, int n) override {
    if (n <= 0) return;
    guarded([&] {
      double* d = scratch(n);
      FASTGPT_CUDA_CHECK(cudaMemcpyAsync(d, x, n * sizeof(double), cudaMemcpyHostToDevice, model_));
      FASTGPT_NCCL_CHECK(ncclAllReduce(d, d, n, ncclFloat64, ncclSum, comm_, model_));
      // Waited for before the copy back: a copy into pageable memory (x) returns only once it is done, so queued
      // behind the collective it would block there, where wait() cannot see a dead peer's error.
      wait(model_);
      FASTGPT_CUDA_CHECK(cudaMemcpyAsync(x, d, n * sizeof(double), cudaMemcpyDeviceToHost, model_));
      wait(model_);
    });
  }
  void all_reduce_doubles(double* x, int n) override {
    if (n <= 0) return;
    guarded([&] { FASTGPT_NCCL_CHECK(ncclAllReduce(x, x, n, ncclFloat64, ncclSum, comm_, model_)); });
  }
  void barrier() override {
    // NCCL has no barrier: a one-element all-reduce completes only once every rank has joined it. The value summed
    // is whatever the scratch holds; only the completion matters.
    guarded([&] {
      FASTGPT_NCCL_CHECK(ncclAllReduce(scratch(1), scratch(1), 1, ncclFloat, ncclSum, comm_, model_));
      wait(model_);
    });
  }

  bool overlaps() const override { return true; }
  void all_reduce_async(const std::vector<std::pair<float*, int64_t>>& slices) override {
    if (slices.empty()) return;
    guarded([&] {
      // The side stream starts after the gradients queued so far on the model's stream exist.
      FASTGPT_CUDA_CHECK(cudaEventRecord(ready_, model_));
      FASTGPT_CUDA_CHECK(cudaStreamWaitEvent(side_, ready_, 0));
      // One group: NCCL fuses the slices into as few kernel launches as it can. A failure inside it still ends
      // the group, so that the thread's next NCCL call is not queued into a group that never launches.
      FASTGPT_NCCL_CHECK(ncclGroupStart());
      try {
        for (const auto& s : slices)
          FASTGPT_NCCL_CHECK(ncclAllReduce(s.first, s.first, s.second, ncclFloat, ncclAvg, comm_, side_));
      } catch (...) {
        (void)ncclGroupEnd();
        throw;
      }
      FASTGPT_NCCL_CHECK(ncclGroupEnd());
    });
  }
  void finish() override {
    guarded([&] {
      FASTGPT_CUDA_CHECK(cudaEventRecord(done_, side_));
      FASTGPT_CUDA_CHECK(cudaStreamWaitEvent(model_, done_, 0));
    });
  }
  void abort() override {
    if (aborted_ || !comm_) return;
    aborted_ = true;
    // Called on error paths, where the first error is the one worth reporting: this one's result is not thrown.
    (void)ncclCommAbort(comm_);
  }

 private:
  // Every entry point: the calling thread may have another device current (restored on return), and any failure
  // marks the communicator as broken so that teardown aborts instead of waiting on peers.
  template <class F>
  void guarded(F&& body) {
    if (aborted_) throw std::runtime_error("the NCCL communicator was aborted after an error; make a new one");
    try {
      const cuda::DeviceGuard guard(device_);
      body();
    } catch (...) {
      failed_ = true;
      throw;
    }
  }

  // A device buffer of at least n doubles, kept between calls (host reductions run every step).
  double* scratch(int n) {
    if (n > scratch_n_) {
      if (scratch_) FASTGPT_CUDA_CHECK(cudaFree(scratch_));
      scratch_ = nullptr;
      scratch_n_ = 0;
      FASTGPT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), n * sizeof(double)));
      scratch_n_ = n;
      // barrier() sums whatever it holds: defined values (initcheck), not the allocation's
      FASTGPT_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, n * sizeof(double), model_));
    }
    return scratch_;
  }

  // cudaStreamSynchronize would block forever if a peer died mid-collective; polling NCCL's asynchronous error
  // state turns that into an exception (and the caller's abort()) instead.
  void wait(cudaStream_t s) {
    for (;;) {
      cudaError_t e = cudaStreamQuery(s);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda::fail("cudaStreamQuery(stream)", cudaGetErrorString(e), __FILE__, __LINE__);
      ncclResult_t async = ncclSuccess;
      FASTGPT_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress)
        cuda::fail("NCCL collective", std::string(ncclGetErrorString(async)) + " (" + ncclGetLastError(comm_) + ")",
                   __FILE__, __LINE__);
      std::this_thread::yield();
    }
  }

  // Never throws: runs from the destructor and from the constructor's failure path; errors are ignored here.
  void teardown() {
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    cudaSetDevice(device_);
    if (comm_ && !aborted_) {
      if (failed_) {
        ncclCommAbort(comm_);
      } else {
        cudaStreamSynchronize(side_);  // an overlapped reduction may still be in flight
        ncclCommDestroy(comm_);
      }
    }
    comm_ = nullptr;
    if (scratch_) cudaFree(scratch_);
    if (done_) cudaEventDestroy(done_);
    if (ready_) cudaEventDestroy(ready_);
    if (side_) cudaStreamDestroy(side_);
    cuda::restore_device(prev, device_);
  }

  int rank_, world_, device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t side_ = nullptr;   // this communicator's own: overlapped reductions
  cudaStream_t model_ = nullptr;  // the model's (use_stream): every other collective
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  double* scratch_ = nullptr;
  int scratch_n_ = 0;
  bool failed_ = false, aborted_ = false;
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  FASTGPT_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

std::shared_ptr<Comm> make_nccl_comm(const std::string& unique_id, int rank, int world, int device) {
  return std::make_shared<NcclComm>(unique_id, rank, world, device);
}

bool built_with_nccl() { return true; }

}  // namespace fastgpt

#endif  // FASTGPT_WITH_NCCL
