// Attention's f32 CPU products alone, forward and backward, on the bench model's shapes: every product
// through each backend (oneDNN's sgemm where this build has it, LibTorch's mm), with and without the
// causal blocks skipped (kernels/batched_matmul.hpp). The runs alternate, so the machine's slow spells
// fall on both sides. Prints the median of each part in ms and writes them to a JSON file.
//
//   cmake --build build --target attention_bench && build/attention_bench [--reps N] [--threads N] [--out FILE]
// (threads: every core by default, as runtime/threads=0 on one rank)
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "lora_trainer/kernels/batched_matmul.hpp"
#include "lora_trainer/kernels/causal_softmax.hpp"
#include "lora_trainer/kernels/cpu_gemm.hpp"

using namespace lt;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t B = 4, T = 256, C = 384, H = 6, D = 64;  // configs/bench_block256.json's micro-batch
constexpr const char* kParts[] = {"scores", "softmax", "weighted", "backward", "total"};

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

// One layer's attention on a (B, T, 3C) c_attn output, as models/layers.cpp computes it on the CPU.
std::array<double, 5> run(const torch::Tensor& x, const torch::Tensor& g, bool causal) {
  auto leaf = x.detach().requires_grad_(true);
  const auto parts = leaf.split(C, -1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  const auto t0 = Clock::now();
  auto s = batched_matmul(q, k.transpose(-2, -1), causal ? CausalPart::Scores : CausalPart::None);
  const auto t1 = Clock::now();
  auto w = causal_softmax(s, 1.0 / 8, {}, torch::kFloat32);
  const auto t2 = Clock::now();
  auto o = batched_matmul(w, v, causal ? CausalPart::Weights : CausalPart::None);
  const auto t3 = Clock::now();
  o.backward(g);
  const auto t4 = Clock::now();
  return {ms(t0, t1), ms(t1, t2), ms(t2, t3), ms(t3, t4), ms(t0, t4)};
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 40, threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string out = "attention_bench.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--threads")) threads = std::max(1, std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--out")) out = argv[i + 1];
  }
  at::set_num_threads(threads);
  torch::manual_seed(0);
  const auto x = torch::randn({B, T, 3 * C});
  const auto g = torch::randn({B, H, T, D});
  std::vector<std::pair<std::string, CpuMatmul>> backends{{"libtorch", CpuMatmul::LibTorch}};
  if (onednn_available()) backends.insert(backends.begin(), {"onednn", CpuMatmul::OneDnn});
  struct Series { std::string name; CpuMatmul backend; bool causal; std::vector<std::array<double, 5>> runs; };
  std::vector<Series> series;
  for (const auto& [name, backend] : backends)
    for (const bool causal : {false, true}) series.push_back({name + (causal ? " causal" : " full"), backend, causal, {}});
  std::printf("attention forward and backward, B %lld H %lld T %lld head %lld, f32, %d threads, %d alternating runs each\n",
              static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(T), static_cast<long long>(D),
              at::get_num_threads(), reps);
  for (int r = -3; r < reps; ++r)  // three warm-up rounds
    for (auto& s : series) {
      set_cpu_matmul(s.backend);
      const auto t = run(x, g, s.causal);
      if (r >= 0) s.runs.push_back(t);
    }
  nlohmann::json report = {{"threads", at::get_num_threads()}, {"reps", reps}, {"median_ms", nlohmann::json::object()}};
  std::printf("%-18s %9s %9s %9s %9s %9s  (median ms)\n", "", kParts[0], kParts[1], kParts[2], kParts[3], kParts[4]);
  for (const auto& s : series) {
    std::printf("%-18s", s.name.c_str());
    for (size_t p = 0; p < 5; ++p) {
      std::vector<double> v;
      for (const auto& t : s.runs) v.push_back(t[p]);
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      std::printf(" %9.2f", v[v.size() / 2]);
      report["median_ms"][s.name][kParts[p]] = v[v.size() / 2];
    }
    std::printf("\n");
  }
  std::ofstream(out) << report.dump(1) << "\n";
  std::printf("wrote %s\n", out.c_str());
}
