// The GPT-2 model engine: one contiguous parameter buffer with named views (llm.c's layout), one gradient buffer
// of the same layout, the activations of the last forward, and forward/backward composed from the kernels of a
// Backend (CPU or CUDA). This is the only place that knows the order of operations in a block; kernels know
// nothing of the model, and nothing here knows Python (the binding in csrc/binding.cpp wraps it).
//
// Precision (llm.c's recipe): activations and the compute weights the kernels read are stored in the storage type
// of the precision (float for fp32/tf32, bf16, f16); the fp32 masters, the gradients (fp32, so micro-batches
// accumulate exactly) and the optimizer moments stay fp32. The order of operations is written once, as member
// templates over the storage type, instantiated for all three. fp16 scales the loss (LossScale, GradScaler's rules).
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/comm.h"

namespace fastgpt {

struct GPTConfig {
  int block_size = 1024;  // max sequence length
  int vocab_size = 50257;
  int n_layer = 12;
  int n_head = 12;
  int n_embd = 768;
  void validate() const;  // throws std::invalid_argument naming the bad field
};

// One parameter tensor in the flat buffer. Per-layer tensors are stacked: layer l's slice starts at
// offset + l * numel / n_layer. `decay` marks the 2-D weights that AdamW decays (build-nanogpt's groups).
struct ParamTensor {
  std::string name;            // build-nanogpt name, "{l}" standing for the layer: "transformer.h.{l}.ln_1.weight"
  std::vector<int64_t> shape;  // one layer's shape, nn.Linear (out, in) for weights
  int64_t offset;              // into the flat buffer, in floats
  int64_t numel;               // all layers together
  bool per_layer;
  bool decay;
  float init_std;              // 0: constant init (init_value)
  float init_value;
};

// A named view of one array: what state_dict() hands out, one entry per layer for stacked tensors.
struct NamedView {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset;
};

enum class Precision { fp32, tf32, bf16, fp16 };
// "fp32" | "tf32" | "bf16" | "fp16"; throws std::invalid_argument naming the choices otherwise.
Precision parse_precision(const std::string& name);
const char* precision_name(Precision p);

class GPT {
 public:
  // With a communicator the model is one replica of a data-parallel job: rank 0's initial weights are broadcast,
  // gradients are reduced (averaged) over ranks once per optimizer step, and the flat buffers are padded to a
  // multiple of world_size shards (ZeRO-1 and reduce-scatter need equal shards; the padding stays zero).
  GPT(const GPTConfig& cfg, uint64_t seed, std::unique_ptr<Backend> backend, Precision precision = Precision::fp32,
      std::shared_ptr<Comm> comm = nullptr);
  ~GPT();

  const GPTConfig& config() const { return cfg_; }
  Backend& backend() { return *be_; }
  int64_t num_parameters() const { return n_params_; }
  int64_t padded_size() const { return params_.size(); }  // of the flat buffers: num_parameters() + padding
  Precision precision() const { return precision_; }
  DType storage() const { return storage_; }  // of activations and compute weights
  uint64_t seed() const { return seed_; }
  float* params() { return params_.data(); }  // fp32 masters, backend memory (device memory for CUDA)
  float* grads() { return grads_.data(); }
  // The weights the kernels read: the masters themselves in fp32/tf32, else their 16-bit copy (storage()).
  void* compute_params() { return storage_ == DType::f32 ? (void*)params_.data() : (void*)cparams_.data(); }
  // Rewrites the compute weights from the masters, rounded to nearest: after the masters were set from outside.
  // Like every change of the weights (load_compute_params, the optimizer's update, a replayed step), it ends the KV
  // cache's continuation (weights_changed()).
  void refresh_compute_params();
  // Sets the compute weights to values given widened to float32 (host, num_parameters()): exact, since each is a
  // value of the storage type. Resuming a bf16 run needs the stochastically rounded weights themselves, which
  // refresh_compute_params() (round to nearest) would not give back. fp32/tf32: nothing to set (the masters).
  void load_compute_params(const float* host);
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  std::vector<NamedView> named_views() const;

  // Runs the model on idx (B, T), host token ids. With targets, returns the mean cross-entropy loss and keeps what
  // backward needs; without, returns NaN. last_only computes logits for the last position of each row only.
  // keep_logits=false (with targets, in a fused model): no logits are kept; the loss is taken over chunks of rows
  // and backward() recomputes each chunk's logits.
  float forward(const int32_t* idx, const int32_t* targets, int B, int T, bool last_only = false,
                bool keep_logits = true);
  // The training step's call: forward with targets and backward (as backward(grad_scale, sync)) in one, returning
  // the mean loss. Fused: lm_head, the loss and its gradient run over chunks of classifier_rows() rows, each
  // chunk's gradient going straight into lm_head's backward, so the (B, T, V) logits never exist and nothing is
  // recomputed. Unfused: forward() then backward(). Leaves no logits.
  float forward_backward(const int32_t* idx, const int32_t* targets, int B, int T, float grad_scale, bool sync = true);
  // Throws std::invalid_argument naming the problem unless idx and targets ((A, B, T) host ids) are a valid batch.
  void check_steps(const int32_t* idx, const int32_t* targets, int A, int B, int T) const;
  // The micro-steps of one optimizer step, queued without waiting for the device: ids, tgts (A, B, T) in backend
  // memory, checked by the caller (check_steps); micro-step a runs as forward_backward(grad_scale 1/A, sync on the
  // last), and step_loss() becomes the sum of their mean losses over A (build-nanogpt's loss_accum), on the device.
  void forward_backward_steps(const int32_t* ids, const int32_t* tgts, int A, int B, int T);
  // The host's state as forward_backward_steps leaves it, after a graph of it was replayed (a graph runs only the
  // device's work). Only for models without a communicator (the host takes part in its reductions).
  void steps_replayed(const int32_t* ids, const int32_t* tgts, int A, int B, int T);
  // Backend memory: one double, the loss of the last forward_backward_steps; step_loss_value() waits and reads it.
  double* step_loss() const { return loss_sums_.data() + 1; }
  double step_loss_value();
  // fused (the default): the classifier as forward_backward says, each residual add fused with the LayerNorm that
  // reads it (ln_2; the next block's ln_1 or ln_f), and the MLP's GELU in the epilogues of the products around it
  // (forward and backward; 16-bit on a GPU); unfused: one kernel per op and the full logits, the "before
  // torch.compile" model. On the CPU the two give the same forward bits.
  void set_fused(bool on) { fused_ = on; }
  bool fused() const { return fused_; }
  // What the forward keeps for backward and what backward makes again instead (llm.c's recompute, what
  // torch.compile's partitioner does to pointwise ops): 0 keeps every activation of every layer; 1 keeps fc's
  // pre-activation but not its GELU, which backward recomputes per layer into a one-layer buffer (4C of the 16C per
  // token and layer); 2 also recomputes ln_1 and ln_2 from the kept residuals and statistics (2C more). Every level
  // gives the same bits where the recomputation uses the forward's own kernel (always on the CPU; on a GPU the
  // LayerNorms, and GELU but for the 16-bit fused model, whose forward GELU is cuBLASLt's epilogue). Only before
  // the first forward: it sets the sizes of the activation buffers.
  void set_recompute(int level);
  int recompute() const { return recompute_; }
  // Rows of logits per classifier chunk (fused model): 4096 on a GPU, 256 on the CPU by default.
  void set_classifier_rows(int64_t rows) {
    if (rows < 1) throw std::invalid_argument("classifier_rows must be >= 1, got " + std::to_string(rows));
    classifier_rows_ = rows;
  }
  int64_t classifier_rows() const { return classifier_rows_; }
  // Logits of the last forward, in backend memory and the storage type: (B, T, V), or (B, 1, V) after last_only.
  // Backward overwrites them.
  const void* logits() const { return logits_.data(); }
  bool logits_valid() const { return logits_valid_; }
  int last_B() const { return B_; }
  int last_T() const { return last_only_ ? 1 : T_; }  // rows of logits per sequence
  // Generation with a KV cache: runs T new tokens idx (B, T), host ids, at positions [pos, pos + T) against the keys
  // and values cached for positions [0, pos), caches theirs, and leaves the logits of each row's last new position
  // in logits() ((B, 1, V), as after a last_only forward). pos 0 starts over (the prefill of a prompt: the causal
  // attention of forward(), so its logits are forward()'s); pos > 0 must equal cache_length() and B the cached
  // batch. pos + T <= block_size. The cache holds what the weights computed at the time: a change of the weights
  // ends it (weights_changed(); start over at pos 0). It invalidates a pending backward, as a forward without
  // targets does.
  void decode(const int32_t* idx, int B, int T, int pos);
  int cache_length() const { return cache_len_; }
  void free_cache();
  // What the old weights computed is no longer used with the new ones: decode() refuses to continue the cached
  // keys and values (cache_length() 0; the buffers stay for the next prefill), so a generation started before an
  // optimizer step or a load starts over at pos 0; and a forward's pending backward is refused (its activations
  // and the classifier's lse are the old weights': PyTorch refuses it too). Called by everything that changes the
  // weights.
  void weights_changed() {
    cache_len_ = 0;
    stale_forward_ = stale_forward_ || have_targets_;
    have_targets_ = false;
  }
  int64_t cache_bytes() const { return kcache_.size() + vcache_.size(); }
  // Adds d(grad_scale * mean loss)/d(params) to the gradient buffer (times the loss scale in fp16, until unscaled).
  // Data parallel: sync=true (the last micro-step of an accumulation) reduces the gradients over ranks, overlapped
  // with the rest of the backward where the communicator can; sync=false only accumulates locally (DDP's no_sync).
  void backward(float grad_scale, bool sync = true);
  void zero_grad();
  // The global sum of squares of the gradients, queued on the device (nothing waits): this rank's part of the
  // reduced gradients (all of them without data parallel) in fixed chunks of cpu::kSumChunk; data parallel: each
  // rank's in-order total in its slot and `loss` (one double, or null) beside it, all slots all-reduced, so that
  // every rank sees every rank's part and loss. The sum is `parts` added in order (chunks, or slots in rank order),
  // the same bits for plain data parallel and ZeRO-1; `losses` are the losses to check (one per rank, or loss).
  struct NormParts {
    const double* parts;
    int nparts;
    const double* losses;
    int nlosses;
  };
  NormParts queue_grad_sumsq(const double* loss = nullptr);

  // ---- data parallel (no-ops without a communicator)
  Comm* comm() const { return comm_.get(); }
  // The communicator, its collectives queued on this model's stream: one communicator per device serves every model
  // there (and the host collectives of fastgpt.distributed), so each user binds its stream before it calls.
  Comm& bound_comm() {
    comm_->use_stream(be_->stream());
    return *comm_;
  }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int world_size() const { return comm_ ? comm_->world_size() : 1; }
  // Reduces gradients accumulated since the last reduction, if any: clip_grad_norm and AdamW call it, so a step
  // never sees local gradients even when no backward asked to sync. Counts reductions (grad_sync_count).
  void sync_grads();
  int64_t grad_sync_count() const { return grad_syncs_; }
  // ZeRO-1 (set by AdamW): gradients are reduce-scattered, each rank keeping only its shard reduced
  // ([shard_begin, shard_begin + shard_size) of the flat buffer); the rest of the gradient buffer is stale.
  void set_zero_stage(int stage);
  int zero_stage() const { return zero_stage_; }
  int64_t shard_size() const { return params_.size() / world_size(); }
  int64_t shard_begin() const { return rank() * shard_size(); }
  // Global L2 norm of the gradients; if above max_norm, scales them by max_norm / (norm + 1e-6) (torch's rule).
  // fp16: unscales first; if the gradients hold an inf/NaN the norm returned is inf/NaN and nothing is clipped.
  double clip_grad_norm(double max_norm);
  // fp16: divides the gradients by the loss scale once per step (a no-op after the first call until zero_grad or
  // backward) and returns whether they hold an inf/NaN. Other precisions: false, without touching the gradients.
  bool unscale_grads();
  // Dynamic loss scaling (fp16 only; cpu/adamw.h's LossScale, GradScaler's rules), its state in backend memory
  // where the cross-entropy kernels and the device step read and update it; other precisions have none.
  bool loss_scaling() const { return precision_ == Precision::fp16; }
  LossScale loss_scale() const;              // a copy (waits for the device)
  void set_loss_scale(const LossScale& s);  // fp16 only
  LossScale* loss_scale_ptr() { return loss_scaling() ? reinterpret_cast<LossScale*>(loss_scale_.data()) : nullptr; }
  void update_loss_scale(bool found_inf);   // on the host: the eager step's, after unscale_grads()
  const float* dloss_scale() { return loss_scaling() ? &loss_scale_ptr()->scale : nullptr; }  // for the kernels
  // fp16: the optimizer took (or skipped) its step on the current gradients; cleared by backward and zero_grad.
  // (The device step leaves them scaled: unscale_grads() refuses them then.)
  // A second step on the same gradients would update the loss scale twice (GradScaler refuses it too).
  bool stepped() const { return stepped_; }
  void mark_stepped() { stepped_ = true; }
  // Bytes of backend memory held by the model: fp32 masters + compute weights, gradients, activations.
  int64_t param_bytes() const { return params_.size() * 4 + cparams_.size(); }
  int64_t grad_bytes() const { return grads_.size() * 4; }
  int64_t activation_bytes() const;

 private:
  void init_params(uint64_t seed);
  // Sum of squares of the (reduced) gradients over all ranks, read back: the parts of queue_grad_sumsq added in
  // order on the host, as adamw_prepare adds them on the device (the same bits).
  double grad_sumsq();
  void reduce_layer_async(int l);  // overlap: layer l's gradients are final
  void ensure_activations(int B, int T);
  void check_ids(const int32_t* ids, int64_t n, const char* what) const;  // in [0, vocab_size)
  // A batches (A, B, T) of ids: shapes and ids in range.
  void check_batch(const int32_t* idx, const int32_t* targets, int B, int T, int A = 1) const;
  // Sizes the buffers, uploads the batch (one staged copy, no wait) and points ids_, tgts_ at it.
  void load_batch(const int32_t* idx, const int32_t* targets, int B, int T);
  void ensure_tokens(int64_t n);
  void ensure_logits(int64_t rows);
  float mean_loss();  // of the last forward's losses (waits for the device)
  // On the loaded batch, queued without waiting: forward (targets: the losses), backward, both.
  void run_forward(bool with_targets, bool last_only, bool keep_logits);
  void run_backward(float grad_scale, bool sync);
  void run_forward_backward(float grad_scale, bool sync);
  void check_backward_allowed() const;
  float begin_backward(float grad_scale, bool sync);  // returns the loss gradient of each row
  void end_backward(bool sync);
  enum class Pass { loss, grad, loss_and_grad };
  // The blocks up to ln_f. cached: decode()'s forward at position pos (keys and values appended to the cache);
  // else positions [0, T).
  template <typename S>
  void forward_t(int B, int T, int pos = 0, bool cached = false);
  // lm_head into logits_ (all rows, or the last of each sequence), then the loss with targets.
  template <typename S>
  void head_t(int B, int T, bool last_only, bool with_targets);
  // lm_head and the loss over chunks of rows (classifier_rows_); grad / loss_and_grad leave dlnf in dbtc_.
  template <typename S>
  void classifier_t(Pass pass, float dloss);
  template <typename S>
  void head_backward_t(float dloss);  // from the kept logits: dlnf in dbtc_
  template <typename S>
  void backward_t();  // from dlnf in dbtc_ down to the embeddings
  template <typename S>
  const S* P(int i, int l = 0) const;  // compute weights of parameter tensor i (its layer l slice)
  float* G(int i, int l = 0);          // gradient tensor i
  // The layer whose slot of ln1_/ln2_ (and of fch_gelu_) layer l uses: its own, or the one slot recompute keeps.
  int ln_slot(int l) const { return recompute_ >= 2 ? 0 : l; }
  int gelu_slot(int l) const { return recompute_ >= 1 ? 0 : l; }
  // Activation buffer a as the storage type, from element `off`.
  template <typename S>
  static S* A(const Buffer<uint8_t>& a, int64_t off = 0) {
    return reinterpret_cast<S*>(a.data()) + off;
  }

  GPTConfig cfg_;
  std::unique_ptr<Backend> be_;
  std::shared_ptr<Comm> comm_;  // after be_: destroyed first, while the stream it uses still exists
  int64_t n_params_ = 0;
  int zero_stage_ = 0;
  int64_t grad_syncs_ = 0;
  bool grads_dirty_ = false;  // local contributions not reduced yet
  bool grads_synced_ = false; // reduced since zero_grad (ZeRO-1 refuses to accumulate onto a reduced shard)
  bool overlap_ = false;      // this backward starts reductions layer by layer
  Precision precision_;
  DType storage_;
  uint64_t seed_;
  Buffer<uint8_t> loss_scale_;  // one LossScale (fp16), backend memory
  bool grads_unscaled_ = false, found_inf_ = false, stepped_ = false;
  double unscaled_sumsq_ = 0.0;  // sum of squares of the gradients, measured by unscale_grads before it scaled
  std::vector<ParamTensor> tensors_;
  Buffer<float> params_, grads_;
  Buffer<uint8_t> cparams_;  // 16-bit compute weights (bf16/fp16 only), parameter layout

  // Activations of the last forward, sized for the largest (B, T) seen. Per-layer ones are stacked (L, B, T, ...).
  int64_t act_bt_ = 0;
  int B_ = 0, T_ = 0;
  bool have_targets_ = false, last_only_ = false, logits_valid_ = false;
  bool stale_forward_ = false;  // the pending backward was dropped by a change of the weights (weights_changed)
  bool chunked_ = false;  // the last forward kept no logits: backward recomputes them chunk by chunk
  bool fused_ = true;
  int recompute_ = 0;
  int64_t classifier_rows_ = 256;
  // Buffer<uint8_t> holds the storage type (A<S>), Buffer<float> is float in every precision.
  // Token ids of the loaded batch: [idx (B, T) | targets (B, T)]; ids_, tgts_ point at the current batch (here, or
  // a micro-batch of forward_backward_steps' input).
  Buffer<int32_t> tokens_;
  const int32_t* ids_ = nullptr;
  const int32_t* tgts_ = nullptr;
  Buffer<uint8_t> encoded_;         // (B, T, C)
  Buffer<uint8_t> ln1_;             // (L, B, T, C); recompute 2: (B, T, C), the current layer's, as ln2_
  Buffer<float> ln1_mean_, ln1_rstd_;  // (L, B, T) x2
  Buffer<uint8_t> qkv_;             // (L, B, T, 3C)
  Buffer<uint8_t> atty_;            // (L, B, T, C)
  Buffer<float> att_lse_;           // (L, B, NH, T)
  Buffer<uint8_t> residual2_;       // (L, B, T, C)
  Buffer<uint8_t> ln2_;
  Buffer<float> ln2_mean_, ln2_rstd_;
  Buffer<uint8_t> fch_, fch_gelu_;  // (L, B, T, 4C); recompute >= 1: fch_gelu_ (B, T, 4C), the current layer's
  Buffer<uint8_t> residual3_;       // (L, B, T, C)
  Buffer<uint8_t> lnf_;             // (B, T, C)
  Buffer<float> lnf_mean_, lnf_rstd_;
  // (B, T, V) when kept, else (classifier_rows, V): one chunk of the fused classifier at a time. Backward (and the
  // fused classifier) write the logit gradients over the logits.
  Buffer<uint8_t> logits_;
  Buffer<float> losses_, ce_lse_;   // (B, T)
  Buffer<double> loss_sums_;        // (2): the last forward's mean loss; the last optimizer step's (step_loss)
  Buffer<double> norm_partials_;    // (chunks of this rank's part of the gradients): sums of squares
  Buffer<double> norm_slots_;       // data parallel (2, world): each rank's sum of squares, then its loss
  // KV cache of decode(): keys and values of positions [0, cache_len_) of cache_B_ rows, per layer
  // (L, B, NH, block_size, hs) each, in the storage type.
  Buffer<uint8_t> kcache_, vcache_;
  int cache_B_ = 0, cache_len_ = 0;
  // Backward scratch, reused across layers (dbtc_ also holds the last rows of a last_only forward).
  Buffer<uint8_t> dresidual_, dbtc_, dbt4c_, dqkv_;
};

}  // namespace fastgpt
