// Choosing among cuBLASLt's candidate algorithms for one product by timing them (fastgpt.ops.matmul_autotune):
// the rules, kept apart from the CUDA timing in cublaslt.cu so that they are tested without a GPU
// (tests/cpp/matmul_tune_test.cpp). Why: cuBLASLt's heuristic ranks its algorithms by a model of the GPU and takes
// the first, as PyTorch does; at GPT-2's narrow products (768 or 2304 columns, 16384 rows) its tile and split-K
// picks decide how well the last wave of tiles fills the SMs, and a training step repeats the same twenty or so
// products forever, so timing a few candidates once per product can pay (PyTorch's TunableOp and Triton's cuBLAS
// autotuning do this; torch.compile's default mode does not). The rules, as theirs:
// - the heuristic's first choice stays unless another is faster by more than kMargin: noise must not flip it;
// - a candidate's time is the median of kRounds timings taken in rounds over all candidates, each round starting
//   one candidate later, so that clock changes and a slow outlier touch every candidate alike;
// - a timing repeats the product until it lasts about kTargetMs (CUDA events resolve about half a microsecond), with
//   the repeat count taken from a second run of the first candidate that ran (its first run can include loading
//   the kernel's module, which CUDA does lazily);
// - a candidate that fails once is out.
// Header-only, plain C++: nothing here knows of CUDA.
#pragma once
#include <algorithm>
#include <vector>

namespace fastgpt::cuda::tune {

constexpr int kMaxCandidates = 8;  // of the heuristic's ranked list
constexpr int kRounds = 5;
constexpr double kMargin = 0.02;
constexpr double kTargetMs = 0.2;
constexpr int kMaxReps = 50;

// Repeats per timing so that one lasts about kTargetMs, for a product that took one_ms once.
inline int reps_for(double one_ms) {
  if (!(one_ms > 0)) return kMaxReps;  // too quick for the events to see (or not a number)
  const double r = kTargetMs / one_ms;
  if (r >= kMaxReps) return kMaxReps;
  const int n = (int)r;
  return n < 1 ? 1 : n + (r > n);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? -1.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Choice {
  int chosen = 0;          // index into the candidates (0: the heuristic's first)
  int reps = 0;            // repeats per timing (0: nothing ran)
  std::vector<double> ms;  // per candidate: the median milliseconds of one product, or -1 where it failed
};

// time(c, reps) runs candidate c reps times back to back and returns the milliseconds they took, or a negative
// number if c cannot run. Calls it once per candidate (warm-up), once more for the first that ran (the repeat
// count; the next one if that fails), then kRounds rounds over those still in.
template <class Time>
Choice choose(int n, Time&& time) {
  Choice ch;
  ch.ms.assign(n, -1.0);
  std::vector<char> in(n, 0);
  for (int c = 0; c < n; c++) in[c] = time(c, 1) >= 0;
  double once = -1;
  for (int c = 0; c < n && once < 0; c++) {
    if (!in[c]) continue;
    once = time(c, 1);
    if (once < 0) in[c] = 0;
  }
  if (once < 0) return ch;  // nothing ran: the heuristic's choice stays, and its own run will say why
  ch.reps = reps_for(once);
  std::vector<std::vector<double>> runs(n);
  for (int r = 0; r < kRounds; r++)
    for (int i = 0; i < n; i++) {
      const int c = (r + i) % n;
      if (!in[c]) continue;
      const double t = time(c, ch.reps);
      if (t < 0)
        in[c] = 0;
      else
        runs[c].push_back(t / ch.reps);
    }
  int best = -1;
  for (int c = 0; c < n; c++) {
    if (!in[c]) continue;
    ch.ms[c] = median(runs[c]);
    if (best < 0 || ch.ms[c] < ch.ms[best]) best = c;
  }
  if (best < 0) return ch;
  ch.chosen = in[0] && ch.ms[best] >= ch.ms[0] * (1.0 - kMargin) ? 0 : best;
  return ch;
}

}  // namespace fastgpt::cuda::tune
