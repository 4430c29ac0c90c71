// Collectives over the ranks of a data-parallel job: the one interface the engine (gpt.cpp, adamw.cpp) uses to
// keep replicas in step. Two implementations: NCCL for CUDA devices (comm_nccl.cu, on the model's stream) and MPI
// for CPU processes (in the binding, over mpi4py, so that the engine needs no MPI headers and any MPI that mpi4py
// was built against works). Nothing here is a hand-written reduction: the libraries do the arithmetic.
//
// Every buffer is the memory of the backend the communicator serves (device memory for NCCL). Results must be
// bitwise the same on every rank: replicas that drift apart by one rounding are no longer replicas. MPI's
// all-reduce algorithms may round differently per rank, so the MPI implementation builds it from reduce-scatter
// + all-gather (each element is reduced on exactly one rank, then copied).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fastgpt {

class Backend;

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;  // "mpi", "nccl"
  // The stream (cudaStream_t) collectives are queued on, after the work already queued there; nullptr for CPU.
  // A model binds its backend's stream when it attaches the communicator.
  virtual void use_stream(void* stream) {}

  // x (n floats) <- the sum (average: the mean) over ranks, bitwise the same on every rank.
  virtual void all_reduce(float* x, int64_t n, bool average) = 0;
  // x holds world_size * shard floats. Afterwards x[rank*shard, (rank+1)*shard) holds the sum (mean) over ranks of
  // that slice; the rest of x is unspecified. ZeRO-1's gradient reduction.
  virtual void reduce_scatter(float* x, int64_t shard, bool average) = 0;
  // x holds world_size * shard_bytes bytes, rank r's slice being its input; afterwards every rank has every slice.
  virtual void all_gather(void* x, int64_t shard_bytes) = 0;
  virtual void broadcast(void* x, int64_t bytes, int root) = 0;
  // Host doubles (losses, squared norms, counts): x (n) <- the sum over ranks, the same on every rank.
  virtual void all_reduce_host(double* x, int n) = 0;
  // The same sum on doubles in backend memory, queued without waiting (NCCL); a CPU backend's memory is the host's.
  virtual void all_reduce_doubles(double* x, int n) { all_reduce_host(x, n); }
  virtual void barrier() = 0;

  // Overlap with the backward (optional). all_reduce_async starts the mean over ranks of these slices now, on the
  // communicator's own stream, after the work queued on the model's stream so far; finish() makes the model's
  // stream wait for everything started. A communicator that cannot overlap reduces at once.
  virtual bool overlaps() const { return false; }
  virtual void all_reduce_async(const std::vector<std::pair<float*, int64_t>>& slices) {
    for (const auto& s : slices) all_reduce(s.first, s.second, true);
  }
  virtual void finish() {}
  // Error paths: tear down without waiting for peers (ncclCommAbort), so a failed rank cannot hang the others.
  virtual void abort() {}
};

}  // namespace fastgpt
