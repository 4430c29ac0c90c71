// GPT-2 forward and backward, composed from the kernels of a Backend (csrc/cpu/ or csrc/cuda/).
// Layout and op order follow build-nanogpt's model exactly (pre-LN blocks, fused QKV, tanh GELU, tied lm_head),
// so a PyTorch model loaded with these weights computes the same function.
#include "engine/gpt.h"

#include <cmath>
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

GPT::GPT(const GPTConfig& cfg, uint64_t seed, std::unique_ptr<Backend> backend) : cfg_(cfg), be_(std::move(backend)) {
  cfg_.validate();
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
  int64_t offset = 0;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    if (s.per_layer) n *= L;
    tensors_.push_back({s.name, s.shape, offset, n, s.per_layer, s.decay, s.std, s.value});
    offset += n;
  }
  params_ = Buffer<float>(be_.get(), offset);
  grads_ = Buffer<float>(be_.get(), offset);
  init_params(seed);
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

const float* GPT::P(int i, int l) const {
  const ParamTensor& t = tensors_[i];
  return params_.data() + t.offset + (t.per_layer ? l * (t.numel / cfg_.n_layer) : 0);
}

float* GPT::G(int i, int l) {
  const ParamTensor& t = tensors_[i];
  return grads_.data() + t.offset + (t.per_layer ? l * (t.numel / cfg_.n_layer) : 0);
}

void GPT::ensure_activations(int B, int T) {
  const int64_t BT = (int64_t)B * T;
  if (BT <= act_bt_) return;
  const int64_t C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, V = cfg_.vocab_size;
  Backend* be = be_.get();
  act_bt_ = BT;
  idx_ = Buffer<int32_t>(be, BT);
  targets_ = Buffer<int32_t>(be, BT);
  encoded_ = Buffer<float>(be, BT * C);
  for (auto* b : {&ln1_, &atty_, &residual2_, &ln2_, &residual3_}) *b = Buffer<float>(be, L * BT * C);
  for (auto* b : {&ln1_mean_, &ln1_rstd_, &ln2_mean_, &ln2_rstd_}) *b = Buffer<float>(be, L * BT);
  qkv_ = Buffer<float>(be, L * BT * 3 * C);
  att_lse_ = Buffer<float>(be, L * BT * NH);
  fch_ = Buffer<float>(be, L * BT * 4 * C);
  fch_gelu_ = Buffer<float>(be, L * BT * 4 * C);
  lnf_ = Buffer<float>(be, BT * C);
  lnf_mean_ = Buffer<float>(be, BT);
  lnf_rstd_ = Buffer<float>(be, BT);
  last_rows_ = Buffer<float>(be, BT * C);
  logits_ = Buffer<float>(be, BT * V);
  losses_ = Buffer<float>(be, BT);
  ce_lse_ = Buffer<float>(be, BT);
  host_losses_.resize(BT);
  dresidual_ = Buffer<float>(be, BT * C);
  dbtc_ = Buffer<float>(be, BT * C);
  dbt4c_ = Buffer<float>(be, BT * 4 * C);
  dqkv_ = Buffer<float>(be, BT * 3 * C);
}

float GPT::forward(const int32_t* idx, const int32_t* targets, int B, int T, bool last_only) {
  const int C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, V = cfg_.vocab_size;
  if (B < 1) throw std::invalid_argument("batch size B must be >= 1, got " + std::to_string(B));
  if (T < 1 || T > cfg_.block_size)
    throw std::invalid_argument("sequence length T must be in [1, block_size=" + std::to_string(cfg_.block_size) +
                                "], got " + std::to_string(T));
  const int64_t BT = (int64_t)B * T;
  auto check_ids = [&](const int32_t* a, const char* what) {
    for (int64_t i = 0; i < BT; i++)
      if (a[i] < 0 || a[i] >= V)
        throw std::invalid_argument(std::string(what) + " must hold token ids in [0, vocab_size=" +
                                    std::to_string(V) + "), found " + std::to_string(a[i]) + " at flat index " +
                                    std::to_string(i));
  };
  check_ids(idx, "idx");
  if (targets) check_ids(targets, "targets");
  if (targets && last_only) throw std::invalid_argument("last_only forward cannot take targets");

  ensure_activations(B, T);
  B_ = B;
  T_ = T;
  be_->upload(idx_.data(), idx, BT * sizeof(int32_t));
  if (targets) be_->upload(targets_.data(), targets, BT * sizeof(int32_t));
  Backend& k = *be_;

  k.encoder_forward(encoded_.data(), idx_.data(), P(WTE), P(WPE), B, T, C);
  for (int l = 0; l < L; l++) {
    const float* residual = l == 0 ? encoded_.data() : residual3_.data() + (l - 1) * BT * C;
    float* ln1 = ln1_.data() + l * BT * C;
    float* qkv = qkv_.data() + l * BT * 3 * C;
    float* atty = atty_.data() + l * BT * C;
    float* res2 = residual2_.data() + l * BT * C;
    float* ln2 = ln2_.data() + l * BT * C;
    float* fch = fch_.data() + l * BT * 4 * C;
    float* fch_gelu = fch_gelu_.data() + l * BT * 4 * C;
    float* res3 = residual3_.data() + l * BT * C;
    k.layernorm_forward(ln1, ln1_mean_.data() + l * BT, ln1_rstd_.data() + l * BT, residual, P(LN1W, l),
                           P(LN1B, l), BT, C);
    k.matmul_forward(qkv, ln1, P(QKVW, l), P(QKVB, l), BT, C, 3 * C);
    k.attention_forward(atty, att_lse_.data() + l * BT * NH, qkv, B, T, C, NH, true);
    // The projection lands in residual2 and the skip is added in place: no separate buffer for it.
    k.matmul_forward(res2, atty, P(ATTPROJW, l), P(ATTPROJB, l), BT, C, C);
    k.residual_forward(res2, res2, residual, BT * C);
    k.layernorm_forward(ln2, ln2_mean_.data() + l * BT, ln2_rstd_.data() + l * BT, res2, P(LN2W, l),
                           P(LN2B, l), BT, C);
    k.matmul_forward(fch, ln2, P(FCW, l), P(FCB, l), BT, C, 4 * C);
    k.gelu_forward(fch_gelu, fch, BT * 4 * C);
    k.matmul_forward(res3, fch_gelu, P(FCPROJW, l), P(FCPROJB, l), BT, 4 * C, C);
    k.residual_forward(res3, res3, res2, BT * C);
  }
  const float* final_res = residual3_.data() + (L - 1) * BT * C;
  k.layernorm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), final_res, P(LNFW), P(LNFB), BT, C);

  last_only_ = last_only;
  have_targets_ = targets != nullptr;
  logits_valid_ = true;
  if (last_only) {
    for (int b = 0; b < B; b++)
      k.copy(last_rows_.data() + (int64_t)b * C, lnf_.data() + ((int64_t)b * T + T - 1) * C, C * sizeof(float));
    k.matmul_forward(logits_.data(), last_rows_.data(), P(WTE), nullptr, B, C, V);  // lm_head tied to wte
    return std::numeric_limits<float>::quiet_NaN();
  }
  k.matmul_forward(logits_.data(), lnf_.data(), P(WTE), nullptr, BT, C, V);
  if (!targets) return std::numeric_limits<float>::quiet_NaN();
  k.cross_entropy_forward(losses_.data(), ce_lse_.data(), logits_.data(), targets_.data(), BT, V);
  k.download(host_losses_.data(), losses_.data(), BT * sizeof(float));
  double sum = 0.0;
  for (int64_t i = 0; i < BT; i++) sum += host_losses_[i];
  return (float)(sum / BT);
}

void GPT::backward(float grad_scale) {
  if (!have_targets_ || !logits_valid_)
    throw std::logic_error("backward() needs a forward() with targets first (and one backward per forward)");
  const int C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, V = cfg_.vocab_size, B = B_, T = T_;
  const int64_t BT = (int64_t)B * T;
  logits_valid_ = false;  // the logit gradients overwrite the logits
  Backend& k = *be_;

  float* dlogits = logits_.data();
  k.cross_entropy_backward(dlogits, logits_.data(), ce_lse_.data(), targets_.data(), grad_scale / (float)BT,
                              BT, V);
  float* dlnf = dbtc_.data();
  k.matmul_backward(dlnf, G(WTE), nullptr, dlogits, lnf_.data(), P(WTE), BT, C, V);
  float* dres = dresidual_.data();  // d(residual stream), accumulated through the blocks
  k.zero(dres, BT * C * sizeof(float));
  k.layernorm_backward(dres, G(LNFW), G(LNFB), dlnf, residual3_.data() + (L - 1) * BT * C, P(LNFW),
                          lnf_mean_.data(), lnf_rstd_.data(), BT, C);
  for (int l = L - 1; l >= 0; l--) {
    const float* residual = l == 0 ? encoded_.data() : residual3_.data() + (l - 1) * BT * C;
    const float* ln1 = ln1_.data() + l * BT * C;
    const float* qkv = qkv_.data() + l * BT * 3 * C;
    const float* atty = atty_.data() + l * BT * C;
    const float* res2 = residual2_.data() + l * BT * C;
    const float* ln2 = ln2_.data() + l * BT * C;
    const float* fch = fch_.data() + l * BT * 4 * C;
    const float* fch_gelu = fch_gelu_.data() + l * BT * 4 * C;
    float* d4c = dbt4c_.data();
    float* dc = dbtc_.data();
    // residual3 = residual2 + mlp(ln2(residual2)): dres flows to both, the MLP branch adds through ln_2.
    k.matmul_backward(d4c, G(FCPROJW, l), G(FCPROJB, l), dres, fch_gelu, P(FCPROJW, l), BT, 4 * C, C);
    k.gelu_backward(d4c, fch, d4c, BT * 4 * C);
    k.matmul_backward(dc, G(FCW, l), G(FCB, l), d4c, ln2, P(FCW, l), BT, C, 4 * C);
    k.layernorm_backward(dres, G(LN2W, l), G(LN2B, l), dc, res2, P(LN2W, l), ln2_mean_.data() + l * BT,
                            ln2_rstd_.data() + l * BT, BT, C);
    // residual2 = residual + attn(ln1(residual)).
    k.matmul_backward(dc, G(ATTPROJW, l), G(ATTPROJB, l), dres, atty, P(ATTPROJW, l), BT, C, C);
    k.attention_backward(dqkv_.data(), dc, qkv, atty, att_lse_.data() + l * BT * NH, B, T, C, NH, true);
    k.matmul_backward(dc, G(QKVW, l), G(QKVB, l), dqkv_.data(), ln1, P(QKVW, l), BT, C, 3 * C);
    k.layernorm_backward(dres, G(LN1W, l), G(LN1B, l), dc, residual, P(LN1W, l), ln1_mean_.data() + l * BT,
                            ln1_rstd_.data() + l * BT, BT, C);
  }
  k.encoder_backward(G(WTE), G(WPE), dres, idx_.data(), B, T, C, V);
}

void GPT::zero_grad() { be_->zero(grads_.data(), grads_.size() * sizeof(float)); }

double GPT::clip_grad_norm(double max_norm) {
  if (!(max_norm > 0.0)) throw std::invalid_argument("max_norm must be > 0, got " + std::to_string(max_norm));
  const double norm = std::sqrt(be_->sum_squares(grads_.data(), grads_.size()));
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) be_->scale_inplace(grads_.data(), grads_.size(), (float)coef);
  return norm;
}

}  // namespace fastgpt
