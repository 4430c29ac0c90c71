// GPT-2 forward and backward, composed from the kernels of a Backend (csrc/cpu/ or csrc/cuda/).
// Layout and op order follow build-nanogpt's model exactly (pre-LN blocks, fused QKV, tanh GELU, tied lm_head),
// so a PyTorch model loaded with these weights computes the same function. forward_t/backward_t are the one copy
// of the order of operations, templates over the storage type S of activations and compute weights; between them
// the classifier, either over the kept (B, T, V) logits (head_t/head_backward_t) or over chunks of rows
// (classifier_t: the fused model's, where the full logits never exist).
#include "engine/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace fastgpt {

namespace {

enum Tensor { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW, FCPROJB,
              LNFW, LNFB, NUM_TENSORS };

// splitmix64 + Box-Muller: a tiny generator whose stream is the same on every platform and compiler
// (std::normal_distribution is not), so a seed means the same weights everywhere.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return ((next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }  // in (0, 1)
  void normal_pair(double& a, double& b) {
    const double r = std::sqrt(-2.0 * std::log(uniform())), th = 6.283185307179586 * uniform();
    a = r * std::cos(th);
    b = r * std::sin(th);
  }
};

std::string layer_name(const std::string& pattern, int l) {
  const auto pos = pattern.find("{l}");
  return pos == std::string::npos ? pattern : pattern.substr(0, pos) + std::to_string(l) + pattern.substr(pos + 3);
}

}  // namespace

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "tf32") return Precision::tf32;
  if (name == "bf16") return Precision::bf16;
  if (name == "fp16") return Precision::fp16;
  throw std::invalid_argument("precision must be one of 'fp32', 'tf32', 'bf16', 'fp16', got '" + name + "'");
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::tf32: return "tf32";
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
  }
  return "?";
}

void GPTConfig::validate() const {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(block_size >= 1, "block_size must be >= 1, got " + std::to_string(block_size));
  need(vocab_size >= 1 && vocab_size <= 65536 * 64, "vocab_size must be in [1, 4194304], got " +
                                                        std::to_string(vocab_size));
  need(n_layer >= 1, "n_layer must be >= 1, got " + std::to_string(n_layer));
  need(n_head >= 1, "n_head must be >= 1, got " + std::to_string(n_head));
  need(n_embd >= 1 && n_embd % n_head == 0, "n_embd must be a positive multiple of n_head (" +
                                                std::to_string(n_head) + "), got " + std::to_string(n_embd));
}

GPT::GPT(const GPTConfig& cfg, uint64_t seed, std::unique_ptr<Backend> backend, Precision precision,
         std::shared_ptr<Comm> comm)
    : cfg_(cfg),
      be_(std::move(backend)),
      comm_(std::move(comm)),
      precision_(precision),
      storage_(precision == Precision::bf16 ? DType::bf16 : precision == Precision::fp16 ? DType::f16 : DType::f32),
      seed_(seed) {
  cfg_.validate();
  be_->check_precision(precision_name(precision));
  be_->set_tf32(precision == Precision::tf32);
  // Chunks of the classifier: on a GPU large enough that lm_head's GEMMs stay efficient and wte's gradient (read
  // and written once per chunk) costs little; on the CPU small, for the memory (the GEMM is as fast).
  classifier_rows_ = be_->is_cuda() ? 4096 : 256;
  const int64_t V = cfg.vocab_size, maxT = cfg.block_size, C = cfg.n_embd, L = cfg.n_layer;
  const float std0 = 0.02f, std_proj = 0.02f / std::sqrt(2.f * (float)L);  // residual projections, GPT-2 style
  struct Spec { const char* name; std::vector<int64_t> shape; bool per_layer, decay; float std, value; };
  const Spec specs[NUM_TENSORS] = {
      {"transformer.wte.weight", {V, C}, false, true, std0, 0.f},
      {"transformer.wpe.weight", {maxT, C}, false, true, std0, 0.f},
      {"transformer.h.{l}.ln_1.weight", {C}, true, false, 0.f, 1.f},
      {"transformer.h.{l}.ln_1.bias", {C}, true, false, 0.f, 0.f},
      {"transformer.h.{l}.attn.c_attn.weight", {3 * C, C}, true, true, std0, 0.f},
      {"transformer.h.{l}.attn.c_attn.bias", {3 * C}, true, false, 0.f, 0.f},
      {"transformer.h.{l}.attn.c_proj.weight", {C, C}, true, true, std_proj, 0.f},
      {"transformer.h.{l}.attn.c_proj.bias", {C}, true, false, 0.f, 0.f},
      {"transformer.h.{l}.ln_2.weight", {C}, true, false, 0.f, 1.f},
      {"transformer.h.{l}.ln_2.bias", {C}, true, false, 0.f, 0.f},
      {"transformer.h.{l}.mlp.c_fc.weight", {4 * C, C}, true, true, std0, 0.f},
      {"transformer.h.{l}.mlp.c_fc.bias", {4 * C}, true, false, 0.f, 0.f},
      {"transformer.h.{l}.mlp.c_proj.weight", {C, 4 * C}, true, true, std_proj, 0.f},
      {"transformer.h.{l}.mlp.c_proj.bias", {C}, true, false, 0.f, 0.f},
      {"transformer.ln_f.weight", {C}, false, false, 0.f, 1.f},
      {"transformer.ln_f.bias", {C}, false, false, 0.f, 0.f},
  };
  // The count in floating point first: a config whose count wraps int64 would allocate a small buffer and be
  // written past its end.
  double count = 0;
  for (const Spec& s : specs) {
    double n = s.per_layer ? (double)L : 1.0;
    for (int64_t d : s.shape) n *= (double)d;
    count += n;
  }
  if (count > 0x1p40)
    throw std::invalid_argument("the config makes " + std::to_string(count) + " parameters, more than 2**40");
  int64_t offset = 0;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    if (s.per_layer) n *= L;
    tensors_.push_back({s.name, s.shape, offset, n, s.per_layer, s.decay, s.std, s.value});
    offset += n;
  }
  n_params_ = offset;
  if (comm_) {
    // Equal shards of a multiple of 64 elements: every shard starts 256-byte aligned in fp32 (128 in 16 bits).
    const int64_t unit = 64 * (int64_t)comm_->world_size();
    offset = (offset + unit - 1) / unit * unit;
  }
  params_ = Buffer<float>(be_.get(), offset);
  grads_ = Buffer<float>(be_.get(), offset);
  if (storage_ != DType::f32) cparams_ = Buffer<uint8_t>(be_.get(), offset * dtype_size(storage_));
  loss_sums_ = Buffer<double>(be_.get(), 2);
  if (loss_scaling()) {
    loss_scale_ = Buffer<uint8_t>(be_.get(), sizeof(LossScale));
    set_loss_scale(LossScale{});  // GradScaler's defaults
  }
  const int64_t norm_n = comm_ ? shard_size() : (int64_t)grads_.size();
  norm_partials_ = Buffer<double>(be_.get(), (norm_n + cpu::kSumChunk - 1) / cpu::kSumChunk);
  norm_slots_ = Buffer<double>(be_.get(), 2 * world_size());
  init_params(seed);
  if (comm_) {  // every replica starts from rank 0's weights, whatever seed each was given
    bound_comm().broadcast(params_.data(), params_.size() * (int64_t)sizeof(float), 0);
    refresh_compute_params();
    // ... and rounds them as rank 0 does: bf16's stochastic rounding is keyed by the seed. 16 bits per double, the
    // other ranks adding zeros: exact, and no device memory needed.
    double parts[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4 && comm_->rank() == 0; i++) parts[i] = (double)((seed_ >> (16 * i)) & 0xFFFF);
    bound_comm().all_reduce_host(parts, 4);
    seed_ = 0;
    for (int i = 0; i < 4; i++) seed_ |= (uint64_t)parts[i] << (16 * i);
  }
}

LossScale GPT::loss_scale() const {
  LossScale s;
  if (!loss_scaling()) {
    s.scale = 1.f;
    return s;
  }
  be_->download(&s, loss_scale_.data(), sizeof s);
  return s;
}

void GPT::set_loss_scale(const LossScale& s) {
  if (!loss_scaling()) throw std::logic_error("loss scaling is used by precision='fp16' only");
  be_->upload(loss_scale_.data(), &s, sizeof s);
}

void GPT::update_loss_scale(bool found_inf) {
  if (!loss_scaling()) return;
  LossScale s = loss_scale();
  loss_scale_update(&s, found_inf);
  set_loss_scale(s);
}

GPT::~GPT() {
  if (comm_) comm_->use_stream(nullptr);  // this model's stream dies with it; the communicator lives on
}

void GPT::set_zero_stage(int stage) {
  if (stage != 0 && stage != 1) throw std::invalid_argument("zero_stage must be 0 or 1, got " + std::to_string(stage));
  if (stage == 1 && !comm_)
    throw std::invalid_argument("zero_stage=1 shards the optimizer over data-parallel ranks: the model has no "
                                "communicator (build it after fastgpt.distributed.init(), data_parallel=True)");
  zero_stage_ = stage;
}

void GPT::refresh_compute_params() {
  weights_changed();
  if (storage_ != DType::f32) be_->narrow(cparams_.data(), storage_, params_.data(), params_.size(), RoundKey{});
}

void GPT::load_compute_params(const float* host) {
  weights_changed();
  if (storage_ == DType::f32) return;
  Buffer<float> staged(be_.get(), n_params_);
  be_->upload(staged.data(), host, n_params_ * (int64_t)sizeof(float));
  be_->narrow(cparams_.data(), storage_, staged.data(), n_params_, RoundKey{});  // nearest of an exact value: itself
}

int64_t GPT::activation_bytes() const {
  int64_t n = 0;
  for (const auto* b : {&encoded_, &ln1_, &qkv_, &atty_, &residual2_, &ln2_, &fch_, &fch_gelu_, &residual3_, &lnf_,
                        &logits_, &dresidual_, &dbtc_, &dbt4c_, &dqkv_})
    n += b->size();
  for (const auto* b : {&ln1_mean_, &ln1_rstd_, &att_lse_, &ln2_mean_, &ln2_rstd_, &lnf_mean_, &lnf_rstd_, &losses_,
                        &ce_lse_})
    n += b->size() * 4;
  return n + tokens_.size() * 4 + loss_sums_.size() * 8;
}

void GPT::set_recompute(int level) {
  if (level < 0 || level > 2) throw std::invalid_argument("recompute must be 0, 1 or 2, got " + std::to_string(level));
  if (act_bt_ > 0 && level != recompute_)
    throw std::logic_error("recompute is set before the first forward (it sizes the activation buffers)");
  recompute_ = level;
}

void GPT::init_params(uint64_t seed) {
  // Drawn on the host (the same stream of numbers whatever the device), then uploaded once.
  Rng rng{seed * 0x2545F4914F6CDD1Dull + 0x1234567ull};
  std::vector<float> host(params_.size());
  for (const ParamTensor& t : tensors_) {
    float* p = host.data() + t.offset;
    if (t.init_std == 0.f) {
      for (int64_t i = 0; i < t.numel; i++) p[i] = t.init_value;
      continue;
    }
    for (int64_t i = 0; i < t.numel; i += 2) {
      double a, b;
      rng.normal_pair(a, b);
      p[i] = (float)(a * t.init_std);
      if (i + 1 < t.numel) p[i + 1] = (float)(b * t.init_std);
    }
  }
  be_->upload(params_.data(), host.data(), (int64_t)host.size() * sizeof(float));
  refresh_compute_params();
}

std::vector<NamedView> GPT::named_views() const {
  std::vector<NamedView> out;
  auto add = [&](int i, int l) {
    const ParamTensor& t = tensors_[i];
    const int64_t per = t.per_layer ? t.numel / cfg_.n_layer : t.numel;
    out.push_back({layer_name(t.name, l), t.shape, t.offset + (t.per_layer ? l * per : 0)});
  };
  add(WTE, 0);
  add(WPE, 0);
  for (int l = 0; l < cfg_.n_layer; l++)
    for (int i = LN1W; i <= FCPROJB; i++) add(i, l);
  add(LNFW, 0);
  add(LNFB, 0);
  out.push_back({"lm_head.weight", tensors_[WTE].shape, tensors_[WTE].offset});  // tied: same storage as wte
  return out;
}

template <typename S>
const S* GPT::P(int i, int l) const {
  const ParamTensor& t = tensors_[i];
  const S* base = storage_ == DType::f32 ? reinterpret_cast<const S*>(params_.data())
                                         : reinterpret_cast<const S*>(cparams_.data());
  return base + t.offset + (t.per_layer ? l * (t.numel / cfg_.n_layer) : 0);
}

float* GPT::G(int i, int l) {
  const ParamTensor& t = tensors_[i];
  return grads_.data() + t.offset + (t.per_layer ? l * (t.numel / cfg_.n_layer) : 0);
}

void GPT::ensure_activations(int B, int T) {
  const int64_t BT = (int64_t)B * T;
  if (BT <= act_bt_) return;
  const int64_t C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head;
  Backend* be = be_.get();
  const int64_t es = dtype_size(storage_);  // bytes per stored activation
  auto act = [&](int64_t n) { return Buffer<uint8_t>(be, n * es); };
  encoded_ = act(BT * C);
  for (auto* b : {&atty_, &residual2_, &residual3_}) *b = act(L * BT * C);
  const int64_t ln_layers = ln_slot(L - 1) + 1, gelu_layers = gelu_slot(L - 1) + 1;  // L, or 1 when recomputed
  for (auto* b : {&ln1_, &ln2_}) *b = act(ln_layers * BT * C);
  for (auto* b : {&ln1_mean_, &ln1_rstd_, &ln2_mean_, &ln2_rstd_}) *b = Buffer<float>(be, L * BT);
  qkv_ = act(L * BT * 3 * C);
  att_lse_ = Buffer<float>(be, L * BT * NH);
  fch_ = act(L * BT * 4 * C);
  fch_gelu_ = act(gelu_layers * BT * 4 * C);
  lnf_ = act(BT * C);
  lnf_mean_ = Buffer<float>(be, BT);
  lnf_rstd_ = Buffer<float>(be, BT);
  losses_ = Buffer<float>(be, BT);
  ce_lse_ = Buffer<float>(be, BT);
  dresidual_ = act(BT * C);
  dbtc_ = act(BT * C);
  dbt4c_ = act(BT * 4 * C);
  dqkv_ = act(BT * 3 * C);
  // Only now: a failed allocation above (out of memory) leaves the old size, which every buffer still holds, and
  // the next call allocates again, instead of running a smaller batch in buffers that were never taken.
  act_bt_ = BT;
}

void GPT::ensure_tokens(int64_t n) {
  if (tokens_.size() >= n) return;
  tokens_ = Buffer<int32_t>();
  tokens_ = Buffer<int32_t>(be_.get(), n);
}

void GPT::ensure_logits(int64_t rows) {
  const int64_t need = rows * cfg_.vocab_size * dtype_size(storage_);
  if (logits_.size() >= need) return;
  logits_ = Buffer<uint8_t>();  // the old one goes before the new one is taken
  logits_ = Buffer<uint8_t>(be_.get(), need);
}

void GPT::check_ids(const int32_t* ids, int64_t n, const char* what) const {
  const int V = cfg_.vocab_size;
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= V)
      throw std::invalid_argument(std::string(what) + " must hold token ids in [0, vocab_size=" + std::to_string(V) +
                                  "), found " + std::to_string(ids[i]) + " at flat index " + std::to_string(i));
}

void GPT::check_batch(const int32_t* idx, const int32_t* targets, int B, int T, int A) const {
  if (B < 1) throw std::invalid_argument("batch size B must be >= 1, got " + std::to_string(B));
  if (T < 1 || T > cfg_.block_size)
    throw std::invalid_argument("sequence length T must be in [1, block_size=" + std::to_string(cfg_.block_size) +
                                "], got " + std::to_string(T));
  check_ids(idx, (int64_t)A * B * T, "idx");
  if (targets) check_ids(targets, (int64_t)A * B * T, "targets");
}

void GPT::load_batch(const int32_t* idx, const int32_t* targets, int B, int T) {
  const int64_t n = (int64_t)B * T;
  ensure_activations(B, T);
  ensure_tokens(targets ? 2 * n : n);
  B_ = B;
  T_ = T;
  // One staged copy, [idx | targets]: no wait for the work already queued.
  const int64_t bytes = (targets ? 2 : 1) * n * (int64_t)sizeof(int32_t);
  int32_t* staged = static_cast<int32_t*>(be_->staging(bytes));
  std::memcpy(staged, idx, n * sizeof(int32_t));
  if (targets) std::memcpy(staged + n, targets, n * sizeof(int32_t));
  be_->copy_staged(tokens_.data(), bytes);
  ids_ = tokens_.data();
  tgts_ = tokens_.data() + n;  // meaningful only when targets were loaded
}

float GPT::mean_loss() {
  be_->loss_accumulate(loss_sums_.data(), losses_.data(), (int64_t)B_ * T_, 1.0, true);
  double mean = 0.0;
  be_->download(&mean, loss_sums_.data(), sizeof(double));
  return (float)mean;
}

double GPT::step_loss_value() {
  double v = 0.0;
  be_->download(&v, step_loss(), sizeof(double));
  return v;
}

float GPT::forward(const int32_t* idx, const int32_t* targets, int B, int T, bool last_only, bool keep_logits) {
  check_batch(idx, targets, B, T);
  if (targets && last_only) throw std::invalid_argument("last_only forward cannot take targets");
  load_batch(idx, targets, B, T);
  run_forward(targets != nullptr, last_only, keep_logits);
  return targets ? mean_loss() : std::numeric_limits<float>::quiet_NaN();
}

void GPT::run_forward(bool with_targets, bool last_only, bool keep_logits) {
  // The fused model keeps no logits it was not asked for: the loss is taken chunk by chunk, and a backward
  // recomputes each chunk's logits (forward_backward, the training step's call, needs no recomputation).
  const bool chunked = fused_ && with_targets && !keep_logits;
  if (!chunked) ensure_logits(last_only ? B_ : (int64_t)B_ * T_);
  with_dtype(storage_, [&](auto s) {
    using S = decltype(s);
    forward_t<S>(B_, T_);
    if (chunked)
      classifier_t<S>(Pass::loss, 0.f);
    else
      head_t<S>(B_, T_, last_only, with_targets);
  });
  last_only_ = last_only;
  have_targets_ = with_targets;
  stale_forward_ = false;
  logits_valid_ = !chunked;
  chunked_ = chunked;
}

float GPT::forward_backward(const int32_t* idx, const int32_t* targets, int B, int T, float grad_scale, bool sync) {
  if (!targets) throw std::invalid_argument("forward_backward needs targets");
  check_backward_allowed();  // before anything changes
  check_batch(idx, targets, B, T);
  load_batch(idx, targets, B, T);
  run_forward_backward(grad_scale, sync);
  return mean_loss();
}

void GPT::check_steps(const int32_t* idx, const int32_t* targets, int A, int B, int T) const {
  if (A < 1) throw std::invalid_argument("the number of micro-batches must be >= 1, got " + std::to_string(A));
  if (!targets) throw std::invalid_argument("a training step needs targets");
  check_batch(idx, targets, B, T, A);
}

void GPT::forward_backward_steps(const int32_t* ids, const int32_t* tgts, int A, int B, int T) {
  check_backward_allowed();
  ensure_activations(B, T);
  B_ = B;
  T_ = T;
  const int64_t BT = (int64_t)B * T;
  const float grad_scale = (float)(1.0 / A);  // the mean over micro-steps, as one big batch would
  for (int a = 0; a < A; a++) {
    ids_ = ids + a * BT;
    tgts_ = tgts + a * BT;
    run_forward_backward(grad_scale, a == A - 1);  // data parallel: reduced once, with the last micro-step
    be_->loss_accumulate(step_loss(), losses_.data(), BT, (double)A, a == 0);
  }
}

void GPT::steps_replayed(const int32_t* ids, const int32_t* tgts, int A, int B, int T) {
  if (comm_) throw std::logic_error("steps_replayed: the host takes part in this model's step");
  // zero_grad, then each micro-step's begin/end_backward (no reduction to start or finish), fused or not.
  B_ = B;
  T_ = T;
  ids_ = ids + (int64_t)(A - 1) * B * T;
  tgts_ = tgts + (int64_t)(A - 1) * B * T;
  logits_valid_ = have_targets_ = chunked_ = last_only_ = stale_forward_ = false;
  grads_unscaled_ = found_inf_ = stepped_ = false;
  grads_synced_ = overlap_ = false;
  grads_dirty_ = true;
  weights_changed();  // the replayed update
}

void GPT::run_forward_backward(float grad_scale, bool sync) {
  if (!fused_) {  // the unfused model: forward then backward, the full logits kept in between
    run_forward(true, false, true);
    run_backward(grad_scale, sync);
    return;
  }
  const float dloss = begin_backward(grad_scale, sync);
  with_dtype(storage_, [&](auto s) {
    using S = decltype(s);
    forward_t<S>(B_, T_);
    classifier_t<S>(Pass::loss_and_grad, dloss);
    backward_t<S>();
  });
  last_only_ = chunked_ = false;
  end_backward(sync);
}

void GPT::decode(const int32_t* idx, int B, int T, int pos) {
  const int maxT = cfg_.block_size;
  if (B < 1) throw std::invalid_argument("batch size B must be >= 1, got " + std::to_string(B));
  if (T < 1 || pos < 0 || pos + T > maxT)
    throw std::invalid_argument("decode: positions [pos, pos + T) = [" + std::to_string(pos) + ", " +
                                std::to_string(pos + T) + ") must be non-empty and within block_size=" +
                                std::to_string(maxT));
  if (pos != 0 && (pos != cache_len_ || B != cache_B_))
    throw std::invalid_argument("decode: position " + std::to_string(pos) + " of " + std::to_string(B) +
                                " rows does not continue the cache, which holds " + std::to_string(cache_len_) +
                                " positions of " + std::to_string(cache_B_) + " rows (pos 0 starts over)");
  check_ids(idx, (int64_t)B * T, "idx");
  cache_len_ = 0;  // until this call completes
  if (B != cache_B_) {
    const int64_t n = (int64_t)cfg_.n_layer * B * maxT * cfg_.n_embd * dtype_size(storage_);
    free_cache();  // the old cache goes before the new one is taken
    kcache_ = Buffer<uint8_t>(be_.get(), n);
    vcache_ = Buffer<uint8_t>(be_.get(), n);
    cache_B_ = B;
  }
  ensure_logits(B);
  load_batch(idx, nullptr, B, T);
  with_dtype(storage_, [&](auto s) {
    forward_t<decltype(s)>(B, T, pos, true);
    head_t<decltype(s)>(B, T, true, false);
  });
  last_only_ = logits_valid_ = true;
  have_targets_ = chunked_ = stale_forward_ = false;
  cache_len_ = pos + T;
}

void GPT::free_cache() {
  kcache_ = Buffer<uint8_t>();
  vcache_ = Buffer<uint8_t>();
  cache_B_ = cache_len_ = 0;
}

template <typename S>
void GPT::forward_t(int B, int T, int pos, bool cached) {
  const int C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, maxT = cfg_.block_size;
  const int64_t BT = (int64_t)B * T;
  Backend& k = *be_;
  // Positions [pos, pos + T): the rows of wpe from pos on.
  k.encoder_forward(A<S>(encoded_), ids_, P<S>(WTE), P<S>(WPE) + (int64_t)pos * C, B, T, C);
  for (int l = 0; l < L; l++) {
    const S* residual = l == 0 ? A<S>(encoded_) : A<S>(residual3_, (l - 1) * BT * C);
    S* ln1 = A<S>(ln1_, ln_slot(l) * BT * C);
    S* qkv = A<S>(qkv_, l * BT * 3 * C);
    S* atty = A<S>(atty_, l * BT * C);
    S* res2 = A<S>(residual2_, l * BT * C);
    S* ln2 = A<S>(ln2_, ln_slot(l) * BT * C);
    S* fch = A<S>(fch_, l * BT * 4 * C);
    S* fch_gelu = A<S>(fch_gelu_, gelu_slot(l) * BT * 4 * C);
    S* res3 = A<S>(residual3_, l * BT * C);
    // Fused: ln_1 of every block but the first was taken with the residual add that ended the block before.
    if (l == 0 || !fused_)
      k.layernorm_forward(ln1, ln1_mean_.data() + l * BT, ln1_rstd_.data() + l * BT, residual, P<S>(LN1W, l),
                          P<S>(LN1B, l), BT, C);
    k.matmul_forward(qkv, ln1, P<S>(QKVW, l), P<S>(QKVB, l), BT, C, 3 * C);
    // decode(): this layer's keys and values join the cache; past the prefill (pos 0, which attends as forward()
    // does) the new rows attend to the cache.
    S* kc = cached ? A<S>(kcache_, (int64_t)l * B * maxT * C) : nullptr;
    S* vc = cached ? A<S>(vcache_, (int64_t)l * B * maxT * C) : nullptr;
    if (cached) k.attention_decode_append(kc, vc, (const S*)qkv, B, T, pos, maxT, C, NH);
    if (cached && pos > 0)
      k.attention_decode_forward(atty, (const S*)qkv, (const S*)kc, (const S*)vc, B, T, pos, maxT, C, NH);
    else
      k.attention_forward(atty, att_lse_.data() + l * BT * NH, qkv, B, T, C, NH, true);
    // The projection lands in residual2 and the skip is added in place: no separate buffer for it.
    k.matmul_forward(res2, atty, P<S>(ATTPROJW, l), P<S>(ATTPROJB, l), BT, C, C);
    float* ln2_mean = ln2_mean_.data() + l * BT;
    float* ln2_rstd = ln2_rstd_.data() + l * BT;
    if (fused_) {  // the skip with ln_2, and fc's GELU as its product's epilogue (the two ops in turn on the CPU)
      k.residual_layernorm_forward(res2, ln2, ln2_mean, ln2_rstd, (const S*)res2, residual, P<S>(LN2W, l),
                                   P<S>(LN2B, l), BT, C);
      k.matmul_forward_gelu(fch_gelu, fch, ln2, P<S>(FCW, l), P<S>(FCB, l), BT, C, 4 * C);
    } else {
      k.residual_forward(res2, res2, residual, BT * C);
      k.layernorm_forward(ln2, ln2_mean, ln2_rstd, res2, P<S>(LN2W, l), P<S>(LN2B, l), BT, C);
      k.matmul_forward(fch, ln2, P<S>(FCW, l), P<S>(FCB, l), BT, C, 4 * C);
      k.gelu_forward(fch_gelu, fch, BT * 4 * C);
    }
    k.matmul_forward(res3, fch_gelu, P<S>(FCPROJW, l), P<S>(FCPROJB, l), BT, 4 * C, C);
    if (!fused_) {
      k.residual_forward(res3, res3, res2, BT * C);
      continue;
    }
    // Fused: the add that ends this block goes with the LayerNorm that reads it, the next block's ln_1 or ln_f.
    const bool last = l == L - 1;
    S* next_ln = last ? A<S>(lnf_) : A<S>(ln1_, ln_slot(l + 1) * BT * C);
    float* next_mean = last ? lnf_mean_.data() : ln1_mean_.data() + (l + 1) * BT;
    float* next_rstd = last ? lnf_rstd_.data() : ln1_rstd_.data() + (l + 1) * BT;
    const S* next_w = last ? P<S>(LNFW) : P<S>(LN1W, l + 1);
    const S* next_b = last ? P<S>(LNFB) : P<S>(LN1B, l + 1);
    k.residual_layernorm_forward(res3, next_ln, next_mean, next_rstd, (const S*)res3, (const S*)res2, next_w, next_b,
                                 BT, C);
  }
  if (fused_) return;  // ln_f was taken with the last block's residual add
  const S* final_res = A<S>(residual3_, (L - 1) * BT * C);
  k.layernorm_forward(A<S>(lnf_), lnf_mean_.data(), lnf_rstd_.data(), final_res, P<S>(LNFW), P<S>(LNFB), BT, C);
}

template <typename S>
void GPT::head_t(int B, int T, bool last_only, bool with_targets) {
  const int C = cfg_.n_embd, V = cfg_.vocab_size;
  const int64_t BT = (int64_t)B * T;
  Backend& k = *be_;
  if (last_only) {  // the last rows gathered into backward's scratch (no backward follows a last_only forward)
    S* rows = A<S>(dbtc_);
    for (int b = 0; b < B; b++) k.copy(rows + (int64_t)b * C, A<S>(lnf_, ((int64_t)b * T + T - 1) * C), C * sizeof(S));
    k.matmul_forward(A<S>(logits_), (const S*)rows, P<S>(WTE), (const S*)nullptr, B, C, V);  // lm_head = wte
    return;
  }
  k.matmul_forward(A<S>(logits_), A<S>(lnf_), P<S>(WTE), (const S*)nullptr, BT, C, V);
  if (with_targets) k.cross_entropy_forward(losses_.data(), ce_lse_.data(), A<S>(logits_), tgts_, BT, V);
}

template <typename S>
void GPT::classifier_t(Pass pass, float dloss) {
  // lm_head, softmax and cross-entropy over chunks of rows, so that only (rows, V) logits exist at a time. With a
  // gradient, each chunk's logits are overwritten by their gradient and go straight into lm_head's backward: dlnf
  // for its rows, and wte's gradient (accumulated over chunks, as over micro-batches).
  const int C = cfg_.n_embd, V = cfg_.vocab_size;
  const int64_t BT = (int64_t)B_ * T_, rows = std::min<int64_t>(classifier_rows_, BT);
  ensure_logits(rows);  // the logits buffer holds one chunk at a time (whatever an earlier forward kept is gone)
  Backend& k = *be_;
  S* z = A<S>(logits_);  // (rows, V)
  for (int64_t r0 = 0; r0 < BT; r0 += rows) {
    const int64_t n = std::min(rows, BT - r0);
    const S* x = A<S>(lnf_, r0 * C);
    float* losses = losses_.data() + r0;
    float* lse = ce_lse_.data() + r0;
    const int32_t* tgt = tgts_ + r0;
    k.matmul_forward(z, x, P<S>(WTE), (const S*)nullptr, n, C, V);
    if (pass == Pass::loss) {
      k.cross_entropy_forward(losses, lse, (const S*)z, tgt, n, V);
      continue;
    }
    if (pass == Pass::grad)  // backward() after a chunked forward: the lse it kept
      k.cross_entropy_backward(z, (const S*)z, lse, tgt, dloss, dloss_scale(), n, V);
    else
      k.cross_entropy_forward_backward(losses, z, (const S*)z, tgt, dloss, dloss_scale(), n, V);
    k.matmul_backward(A<S>(dbtc_, r0 * C), G(WTE), nullptr, (const S*)z, x, P<S>(WTE), n, C, V);
  }
}

void GPT::check_backward_allowed() const {
  if (grads_unscaled_)
    throw std::logic_error("backward() after the gradients were unscaled (clip_grad_norm or a skipped step) adds "
                           "scaled gradients to unscaled ones: call zero_grad() first");
  if (loss_scaling() && stepped_)  // train_step's: still scaled, but by a scale that may have moved on since
    throw std::logic_error("backward() onto gradients an fp16 step already used adds gradients of another loss "
                           "scale to them: call zero_grad() first");
  if (comm_ && zero_stage_ == 1 && grads_synced_)
    throw std::logic_error("backward() onto gradients already reduced for ZeRO-1 (each rank holds only its shard "
                           "reduced): call zero_grad() first, and sync only the last micro-step of an accumulation");
}

float GPT::begin_backward(float grad_scale, bool sync) {
  logits_valid_ = false;  // the logit gradients overwrite the logits
  have_targets_ = false;  // one backward per forward
  stepped_ = false;
  overlap_ = comm_ && sync && zero_stage_ == 0 && comm_->overlaps();
  return (float)(grad_scale / ((double)B_ * T_));  // fp16: the kernels multiply by the loss scale in memory
}

void GPT::end_backward(bool sync) {
  grads_dirty_ = true;
  if (sync) sync_grads();
}

void GPT::backward(float grad_scale, bool sync) {
  if (stale_forward_)
    throw std::logic_error("backward() after the weights changed since its forward() (an optimizer step, a load): "
                           "the forward's activations are of the old weights; run forward() again");
  if (!have_targets_)
    throw std::logic_error("backward() needs a forward() with targets first (and one backward per forward)");
  check_backward_allowed();
  run_backward(grad_scale, sync);
}

void GPT::run_backward(float grad_scale, bool sync) {
  const bool chunked = chunked_;
  const float dloss = begin_backward(grad_scale, sync);
  with_dtype(storage_, [&](auto s) {
    using S = decltype(s);
    if (chunked)
      classifier_t<S>(Pass::grad, dloss);
    else
      head_backward_t<S>(dloss);
    backward_t<S>();
  });
  chunked_ = false;
  end_backward(sync);
}

void GPT::reduce_layer_async(int l) {
  // The per-layer tensors are stacked (tensor-major), so one layer's gradients are one slice of each of them.
  std::vector<std::pair<float*, int64_t>> slices;
  for (int i = LN1W; i <= FCPROJB; i++) slices.push_back({G(i, l), tensors_[i].numel / cfg_.n_layer});
  bound_comm().all_reduce_async(slices);
}

void GPT::sync_grads() {
  if (!comm_ || !grads_dirty_) return;
  Comm& c = bound_comm();
  if (overlap_) {  // the layers are on their way; wte (lm_head and embedding), wpe and ln_f were written last
    std::vector<std::pair<float*, int64_t>> rest;
    for (int i : {WTE, WPE, LNFW, LNFB}) rest.push_back({G(i), tensors_[i].numel});
    c.all_reduce_async(rest);
    c.finish();
  } else if (zero_stage_ == 1) {
    c.reduce_scatter(grads_.data(), shard_size(), true);
  } else {
    c.all_reduce(grads_.data(), grads_.size(), true);
  }
  overlap_ = grads_dirty_ = false;
  grads_synced_ = true;
  grad_syncs_++;
}

GPT::NormParts GPT::queue_grad_sumsq(const double* loss) {
  const int64_t b = comm_ ? shard_begin() : 0, n = comm_ ? shard_size() : (int64_t)grads_.size();
  be_->sum_squares_partials(norm_partials_.data(), grads_.data() + b, n);
  if (!comm_) return {norm_partials_.data(), (int)norm_partials_.size(), loss, loss ? 1 : 0};
  // A slot per rank (adding the zeros of the others is exact) and one for its loss: one collective for both.
  const int world = world_size(), r = rank();
  double* slots = norm_slots_.data();
  be_->zero(slots, norm_slots_.size() * (int64_t)sizeof(double));
  be_->sum_in_order(slots + r, norm_partials_.data(), norm_partials_.size());
  if (loss) be_->copy(slots + world + r, loss, sizeof(double));
  bound_comm().all_reduce_doubles(slots, 2 * world);
  return {slots, world, loss ? slots + world : nullptr, loss ? world : 0};
}

double GPT::grad_sumsq() {
  const NormParts p = queue_grad_sumsq();
  std::vector<double> parts(p.nparts);
  be_->download(parts.data(), p.parts, p.nparts * (int64_t)sizeof(double));
  double ss = 0.0;
  cpu::sum_in_order(&ss, parts.data(), p.nparts);
  return ss;
}

template <typename S>
void GPT::head_backward_t(float dloss) {
  const int C = cfg_.n_embd, V = cfg_.vocab_size;
  const int64_t BT = (int64_t)B_ * T_;
  Backend& k = *be_;
  S* dlogits = A<S>(logits_);
  k.cross_entropy_backward(dlogits, A<S>(logits_), ce_lse_.data(), tgts_, dloss, dloss_scale(), BT, V);
  k.matmul_backward(A<S>(dbtc_), G(WTE), nullptr, dlogits, A<S>(lnf_), P<S>(WTE), BT, C, V);
}

template <typename S>
void GPT::backward_t() {
  const int C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, V = cfg_.vocab_size, B = B_, T = T_;
  const int64_t BT = (int64_t)B * T;
  Backend& k = *be_;
  const S* dlnf = A<S>(dbtc_);  // from the classifier
  S* dres = A<S>(dresidual_);  // d(residual stream), accumulated through the blocks
  k.zero(dres, BT * C * sizeof(S));
  // Fused: a residual projection's bias gradient is the column sums of dres where the projection adds into the
  // stream, which the LayerNorm backward before it has just made: it sums them as it writes (on a GPU in 16 bits;
  // the unfused model's column-sum pass elsewhere, the same bits). That is attn.c_proj's after ln_2, mlp.c_proj's
  // after the next block's ln_1 (ln_f for the last block): one read of dres fewer for each.
  const auto proj_db = [&](int id, int l) { return fused_ && l >= 0 ? G(id, l) : nullptr; };
  k.layernorm_backward(dres, G(LNFW), G(LNFB), dlnf, A<S>(residual3_, (L - 1) * BT * C), P<S>(LNFW),
                       lnf_mean_.data(), lnf_rstd_.data(), BT, C, proj_db(FCPROJB, L - 1));
  for (int l = L - 1; l >= 0; l--) {
    const S* residual = l == 0 ? A<S>(encoded_) : A<S>(residual3_, (l - 1) * BT * C);
    S* ln1 = A<S>(ln1_, ln_slot(l) * BT * C);
    const S* qkv = A<S>(qkv_, l * BT * 3 * C);
    const S* atty = A<S>(atty_, l * BT * C);
    const S* res2 = A<S>(residual2_, l * BT * C);
    S* ln2 = A<S>(ln2_, ln_slot(l) * BT * C);
    const S* fch = A<S>(fch_, l * BT * 4 * C);
    S* fch_gelu = A<S>(fch_gelu_, gelu_slot(l) * BT * 4 * C);
    S* d4c = A<S>(dbt4c_);
    S* dc = A<S>(dbtc_);
    S* dqkv = A<S>(dqkv_);
    float* ln1_mean = ln1_mean_.data() + l * BT;
    float* ln1_rstd = ln1_rstd_.data() + l * BT;
    float* ln2_mean = ln2_mean_.data() + l * BT;
    float* ln2_rstd = ln2_rstd_.data() + l * BT;
    // Recomputed activations, each made again just before its one reader, by the op that made it in forward (the
    // LayerNorms rewrite their statistics with the same values).
    if (recompute_ >= 1) k.gelu_forward(fch_gelu, fch, BT * 4 * C);
    if (recompute_ >= 2) k.layernorm_forward(ln2, ln2_mean, ln2_rstd, res2, P<S>(LN2W, l), P<S>(LN2B, l), BT, C);
    // residual3 = residual2 + mlp(ln2(residual2)): dres flows to both, the MLP branch adds through ln_2.
    if (fused_) {  // GELU's backward as the epilogue of the product that makes its input's gradient
      k.matmul_backward_dgelu(d4c, G(FCPROJW, l), nullptr, dres, fch_gelu, P<S>(FCPROJW, l), fch, BT, 4 * C, C);
    } else {
      k.matmul_backward(d4c, G(FCPROJW, l), G(FCPROJB, l), dres, fch_gelu, P<S>(FCPROJW, l), BT, 4 * C, C);
      k.gelu_backward(d4c, fch, d4c, BT * 4 * C);
    }
    k.matmul_backward(dc, G(FCW, l), G(FCB, l), d4c, ln2, P<S>(FCW, l), BT, C, 4 * C);
    k.layernorm_backward(dres, G(LN2W, l), G(LN2B, l), dc, res2, P<S>(LN2W, l), ln2_mean, ln2_rstd, BT, C,
                         proj_db(ATTPROJB, l));
    // residual2 = residual + attn(ln1(residual)).
    k.matmul_backward(dc, G(ATTPROJW, l), fused_ ? nullptr : G(ATTPROJB, l), dres, atty, P<S>(ATTPROJW, l), BT, C, C);
    // Fused: qkv's bias gradient with the attention backward, which on an H100/H200 has the K and V thirds from the
    // kernel's own tiles (the rest, or all of it elsewhere, is matmul_backward's pass over dqkv, the same bits).
    k.attention_backward(dqkv, dc, qkv, atty, att_lse_.data() + l * BT * NH, B, T, C, NH, true,
                         fused_ ? G(QKVB, l) : nullptr);
    if (recompute_ >= 2) k.layernorm_forward(ln1, ln1_mean, ln1_rstd, residual, P<S>(LN1W, l), P<S>(LN1B, l), BT, C);
    k.matmul_backward(dc, G(QKVW, l), fused_ ? nullptr : G(QKVB, l), dqkv, ln1, P<S>(QKVW, l), BT, C, 3 * C);
    k.layernorm_backward(dres, G(LN1W, l), G(LN1B, l), dc, residual, P<S>(LN1W, l), ln1_mean, ln1_rstd, BT, C,
                         proj_db(FCPROJB, l - 1));
    if (overlap_) reduce_layer_async(l);  // nothing below this layer writes its gradients again
  }
  k.encoder_backward(G(WTE), G(WPE), (const S*)dres, ids_, B, T, C, V);
}

void GPT::zero_grad() {
  be_->zero(grads_.data(), grads_.size() * sizeof(float));
  grads_unscaled_ = found_inf_ = stepped_ = false;
  grads_dirty_ = grads_synced_ = overlap_ = false;
}

bool GPT::unscale_grads() {
  sync_grads();
  if (!loss_scaling() || grads_unscaled_) return found_inf_;
  if (stepped_)  // by the device step, which divides the scale out inside the update and leaves them scaled
    throw std::logic_error("these gradients were already stepped on, and the loss scale has moved on since: call "
                           "zero_grad() and run a new backward()");
  // One pass finds a non-finite gradient (its square sums to inf/NaN in double) before anything is scaled; with
  // data parallel it is the global sum, so every rank skips (or takes) the step together.
  const double ss = grad_sumsq();
  const double scale = loss_scale().scale;
  found_inf_ = !std::isfinite(ss);
  if (!found_inf_) be_->scale_inplace(grads_.data(), grads_.size(), 1.f / (float)scale);
  unscaled_sumsq_ = ss / (scale * scale);
  grads_unscaled_ = true;
  return found_inf_;
}

double GPT::clip_grad_norm(double max_norm) {
  if (!(max_norm > 0.0)) throw std::invalid_argument("max_norm must be > 0, got " + std::to_string(max_norm));
  // fp16's first call unscales, and the norm comes from that same pass: one reduction (and one sync), not two.
  const bool unscales_now = loss_scaling() && !grads_unscaled_;
  if (unscale_grads()) return std::numeric_limits<double>::infinity();
  const double norm = std::sqrt(unscales_now ? unscaled_sumsq_ : grad_sumsq());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) be_->scale_inplace(grads_.data(), grads_.size(), (float)coef);
  return norm;
}

}  // namespace fastgpt
