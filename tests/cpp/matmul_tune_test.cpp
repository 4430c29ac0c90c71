// The rules by which fastgpt.ops.matmul_autotune picks one of cuBLASLt's candidate algorithms
// (csrc/cuda/matmul_tune.h), run against a fake clock: which candidate wins, when the heuristic's first choice
// stays, what a failing candidate or a slow outlier does, how many repeats a timing takes and in what order the
// candidates are timed. The CUDA side (events, scratch outputs, cuBLASLt) needs a GPU; these rules do not.
// Built and run by tests/test_matmul.py::test_autotune_rules; prints "failures N" last and exits non-zero on any.
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

#include "cuda/matmul_tune.h"

namespace tune = fastgpt::cuda::tune;

static int g_checks = 0, g_failures = 0;
#define CHECK(cond, ...)                          \
  do {                                            \
    g_checks++;                                   \
    if (!(cond)) {                                \
      g_failures++;                               \
      std::printf("FAIL line %d: ", __LINE__);    \
      std::printf(__VA_ARGS__);                   \
      std::printf("  [%s]\n", #cond);             \
    }                                             \
  } while (0)

// A fake GPU: candidate c takes base[c] ms per product, times a noise factor 1 +- noise from a fixed sequence;
// fail_at[c] = k makes its k-th call (0-based; -1 never) and every later one fail; spike = {c, k} multiplies c's
// k-th call by 20. Keeps the (candidate, reps) of every call.
struct FakeGpu {
  std::vector<double> base;
  double noise = 0.005;
  std::vector<int> fail_at;
  std::pair<int, int> spike{-1, -1};
  std::vector<int> calls;
  std::vector<std::pair<int, int>> log;
  unsigned state = 12345;

  explicit FakeGpu(std::vector<double> b) : base(std::move(b)), fail_at(base.size(), -1), calls(base.size(), 0) {}
  double operator()(int c, int reps) {
    log.push_back({c, reps});
    const int k = calls[c]++;
    if (fail_at[c] >= 0 && k >= fail_at[c]) return -1.0;
    state = state * 1664525u + 1013904223u;
    const double u = (state >> 8) / double(1u << 24) * 2.0 - 1.0;  // [-1, 1)
    double t = base[c] * reps * (1.0 + noise * u);
    if (spike.first == c && spike.second == k) t *= 20.0;
    return t;
  }
};

static tune::Choice run(FakeGpu& g) {
  return tune::choose((int)g.base.size(), [&](int c, int reps) { return g(c, reps); });
}

int main() {
  // reps_for: a timing lasts about kTargetMs (0.2), between 1 and kMaxReps (50) repeats.
  CHECK(tune::reps_for(0.2) == 1, "%d", tune::reps_for(0.2));
  CHECK(tune::reps_for(1.5) == 1, "%d", tune::reps_for(1.5));
  CHECK(tune::reps_for(0.1) == 2, "%d", tune::reps_for(0.1));
  CHECK(tune::reps_for(0.03) == 7, "%d", tune::reps_for(0.03));
  CHECK(tune::reps_for(0.0041) == 49, "%d", tune::reps_for(0.0041));
  CHECK(tune::reps_for(0.004) == 50, "%d", tune::reps_for(0.004));
  CHECK(tune::reps_for(1e-9) == 50, "%d", tune::reps_for(1e-9));
  CHECK(tune::reps_for(0.0) == 50, "%d", tune::reps_for(0.0));
  CHECK(tune::reps_for(std::numeric_limits<double>::quiet_NaN()) == 50, "NaN");
  CHECK(tune::median({3, 1, 2}) == 2 && tune::median({4, 1, 3, 2}) == 2.5 && tune::median({}) == -1, "median");

  {  // a clearly faster candidate wins; its time is its own
    FakeGpu g({1.0, 0.8, 1.1, 0.95});
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 1, "chosen %d", ch.chosen);
    CHECK(ch.reps == 1, "reps %d", ch.reps);
    CHECK(std::fabs(ch.ms[1] - 0.8) < 0.8 * 0.006 && std::fabs(ch.ms[2] - 1.1) < 1.1 * 0.006, "ms %g %g", ch.ms[1],
          ch.ms[2]);
    // The call order: a warm-up each, a second run of candidate 0 for the repeat count, then five rounds, round r
    // starting at candidate r % 4.
    std::vector<std::pair<int, int>> want = {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {0, 1}};
    for (int r = 0; r < tune::kRounds; r++)
      for (int i = 0; i < 4; i++) want.push_back({(r + i) % 4, 1});
    CHECK(g.log == want, "call order (%zu calls)", g.log.size());
  }
  {  // 1% faster is within the margin: the heuristic's choice stays
    FakeGpu g({1.0, 0.99, 1.3});
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 0, "chosen %d", ch.chosen);
    CHECK(ch.ms[1] < ch.ms[0], "the other is faster, but not by the margin: %g %g", ch.ms[1], ch.ms[0]);
  }
  {  // 3% faster is past it
    FakeGpu g({1.0, 0.97});
    g.noise = 0.001;
    CHECK(run(g).chosen == 1, "past the margin");
  }
  {  // the fastest fails at its warm-up: out, called once, never chosen
    FakeGpu g({1.0, 0.5, 0.9});
    g.fail_at[1] = 0;
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 2 && ch.ms[1] == -1.0 && g.calls[1] == 1, "chosen %d ms %g calls %d", ch.chosen, ch.ms[1],
          g.calls[1]);
  }
  {  // the heuristic's first fails: the fastest of the rest, margin or not
    FakeGpu g({1.0, 1.0, 0.995});
    g.fail_at[0] = 0;
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 2 && ch.ms[0] == -1.0, "chosen %d", ch.chosen);
    CHECK(g.log[3] == std::make_pair(1, 1), "repeat count from candidate 1 (call 3 is %d)", g.log[3].first);
  }
  {  // the first fails on its second call (the repeat count): the count comes from the next, the first is out
    FakeGpu g({0.5, 1.0, 0.9});
    g.fail_at[0] = 1;
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 2 && ch.ms[0] == -1.0 && g.calls[0] == 2, "chosen %d calls %d", ch.chosen, g.calls[0]);
  }
  {  // nothing runs: the heuristic's choice, nothing timed
    FakeGpu g({1.0, 1.0});
    g.fail_at = {0, 0};
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 0 && ch.reps == 0 && ch.ms[0] == -1.0 && ch.ms[1] == -1.0 && g.log.size() == 2,
          "chosen %d reps %d calls %zu", ch.chosen, ch.reps, g.log.size());
  }
  {  // a slow outlier (20x in one round) does not lose the fastest its place
    FakeGpu g({1.0, 0.9});
    g.spike = {1, 3};
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 1 && ch.ms[1] < 0.91, "chosen %d ms %g", ch.chosen, ch.ms[1]);
  }
  {  // a candidate that fails in a later round is out, fastest or not
    FakeGpu g({1.0, 0.7, 0.9});
    g.fail_at[1] = 4;
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 2 && ch.ms[1] == -1.0, "chosen %d ms %g", ch.chosen, ch.ms[1]);
  }
  {  // quick products take repeats; times are per product
    FakeGpu g({0.01, 0.008});
    const tune::Choice ch = run(g);
    CHECK(ch.reps == 20, "reps %d", ch.reps);
    CHECK(ch.chosen == 1 && std::fabs(ch.ms[1] - 0.008) < 0.008 * 0.006, "chosen %d ms %g", ch.chosen, ch.ms[1]);
    int timed = 0;
    for (auto& [c, reps] : g.log) timed += reps == 20;
    CHECK(timed == 2 * tune::kRounds, "timed calls %d", timed);
  }
  {  // one candidate: timed anyway (the report shows its time), and chosen
    FakeGpu g({0.3});
    const tune::Choice ch = run(g);
    CHECK(ch.chosen == 0 && ch.ms[0] > 0.29 && ch.ms[0] < 0.31, "ms %g", ch.ms[0]);
  }
  std::printf("matmul_tune: %d checks, failures %d\n", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
