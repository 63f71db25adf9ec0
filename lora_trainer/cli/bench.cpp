#include "lora_trainer/cli/bench.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include <torch/csrc/autograd/profiler_legacy.h>

#include "lora_trainer/training/trainer.hpp"
#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/dataset_style.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/runtime.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"


namespace fs = std::filesystem;

namespace lt {

double measure_matmul_peak(int64_t n, bool bf16, const Runtime& rt) {
  auto opts = torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32).device(rt.device);
  auto a = torch::randn({n, n}, opts.dtype(torch::kFloat32)).to(opts), b = torch::randn({n, n}, opts.dtype(torch::kFloat32)).to(opts);
  torch::NoGradGuard ng;
  for (int i = 0; i < 3; ++i) torch::mm(a, b);  // warm up (oneDNN primitive creation, cuBLAS handles)
  rt.synchronize();
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = now_seconds();
    for (int i = 0; i < 4; ++i) torch::mm(a, b);
    rt.synchronize();
    best = std::min(best, (now_seconds() - t0) / 4);
  }
  return 2.0 * static_cast<double>(n) * n * n / best;
}

static double peak_rss_mb() { return ProcessMemory::now().peak / 1048576.0; }

struct CpuAllocatorPeak::Listener : c10::MemoryReportingInfoBase {
  std::atomic<int64_t> now{0}, peak{0};
  void reportMemoryUsage(void*, int64_t alloc_size, compat::MemoryTotal, compat::MemoryTotal, c10::Device device) override {
    if (!device.is_cpu()) return;
    const int64_t held = now.fetch_add(alloc_size) + alloc_size;  // a free reports a negative size
    int64_t seen = peak.load();
    while (held > seen && !peak.compare_exchange_weak(seen, held)) {
    }
  }
  bool memoryProfilingEnabled() const override { return true; }
};

CpuAllocatorPeak::CpuAllocatorPeak()
    : listener_(std::make_shared<Listener>()),
      guard_(std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, listener_)) {}

CpuAllocatorPeak::~CpuAllocatorPeak() = default;

int64_t CpuAllocatorPeak::peak_bytes() const { return listener_->peak.load(); }

static double current_rss_mb() { return ProcessMemory::now().resident() / 1048576.0; }

static int64_t bytes_of(const NamedTensors& ts) {
  int64_t b = 0;
  for (const auto& [n, t] : ts) b += t.numel() * t.element_size();
  return b;
}

// A PMD dataset of uniformly random tokens: the benchmark measures speed, not learning.
static void write_random_dataset(const std::string& dir, int64_t vocab, int64_t tokens) {
  fs::create_directories(dir);
  auto ids = torch::randint(0, vocab, {tokens}, torch::TensorOptions().dtype(torch::kInt32)).contiguous();
  std::string bytes(reinterpret_cast<const char*>(ids.data_ptr<int32_t>()), static_cast<size_t>(tokens) * 4);
  write_file_atomic(dir + "/train.bin", bytes);
  write_file_atomic(dir + "/val.bin", bytes.substr(0, std::min<size_t>(bytes.size(), 4 * 65536)));
  write_file_atomic(dir + "/meta.json", nlohmann::json({{"style", style_name(DatasetStyle::PMD)}, {"vocab_size", vocab}}).dump());
}

namespace {

struct PhaseTimes {
  std::vector<double> step_seconds;
  double median() const {
    auto v = step_seconds;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  }
  double quantile(double q) const {
    auto v = step_seconds;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
  }
};

// The CUDA driver's cuProfilerStart / cuProfilerStop, looked up when needed (no build dependency):
// a profiler started with --profile-from-start off records only the kernels between them.
void cuda_profiler(bool start) {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!driver) driver = dlopen("libcuda.so.1", RTLD_NOW);
  using Fn = int (*)();
  const char* name = start ? "cuProfilerStart" : "cuProfilerStop";
  auto fn = driver ? reinterpret_cast<Fn>(dlsym(driver, name)) : nullptr;
  if (!fn) throw UserError(std::string("bench --cuda-profile: the CUDA driver (libcuda.so.1) has no ") + name);
  if (const int rc = fn(); rc != 0) throw UserError(std::string("bench --cuda-profile: ") + name + " failed (CUresult " + std::to_string(rc) + ")");
}

}  // namespace

namespace {

// The bench's job: the config's model and batch (a lora/train config), phases sized to warmup + timed
// steps, synthetic data written under `tmp`.
std::unique_ptr<RestorableJob> make_bench_job(const BenchOptions& o, const fs::path& tmp) {
  std::vector<std::string> ov = o.overrides;
  const Config pc = make_config(o.config_path, ov);
  if (pc.get_string("job/kind") != "lora/train")
    throw UserError(o.config_path + ": bench needs a lora/train config (its job/kind is " + pc.get_string("job/kind") + ")");
  const ModelOptions model = ModelOptions::from_config(pc);
  const int64_t vocab = model.vocab_size;
  const int64_t tps = TrainingOptions::from_config(pc).batch_size * model.block_size;
  const int64_t per_phase = (o.warmup_steps + o.steps) * tps;
  write_random_dataset((tmp / "data" / "random").string(), vocab, std::max<int64_t>(per_phase * 2, 1 << 20));
  const std::string data = R"([[{"name":"random","rate":1}]])";
  for (const std::string& s : std::vector<std::string>{"data/dir=\"" + (tmp / "data").string() + "\"", "training/pre_lora_tokens=[" + std::to_string(per_phase) + "]",
                        "training/post_lora_tokens=[" + std::to_string(per_phase) + "]", "training/pre_lora_dataset=" + data,
                        "training/post_lora_dataset=" + data, "training/validation=false", "logging/report_interval=1000000",
                        "logging/checkpoint_interval=1000000"})
    ov.push_back(s);
  return make_job("bench", o.config_path, tmp.string(), ov);
}

// --weights-out: the reference script starts from exactly these weights and checks its loss on this
// batch against ours (like for like: same weights, same tokens, same precision).
nlohmann::json write_first_batch_check(Trainer& t, const std::string& path) {
  const Runtime& rt = t.runtime();
  const ModelOptions& m = t.model()->options();
  auto gen = at::detail::createCPUGenerator(1234);
  auto window = torch::randint(0, m.vocab_size, {t.batch_size(), m.block_size + 1}, gen,
                               torch::TensorOptions().dtype(torch::kLong));
  auto inputs = window.slice(1, 0, m.block_size).contiguous(), targets = window.slice(1, 1).contiguous();
  double loss;
  {
    torch::NoGradGuard ng;
    AutocastGuard autocast(rt);
    auto sum = t.model()->loss_sum(inputs.to(rt.device), targets.to(rt.device));
    loss = sum.item<double>() / static_cast<double>(count_targets(targets));
  }
  c10::Dict<std::string, torch::Tensor> d;
  for (auto& [n, p] : named_params(*t.model())) d.insert(n, p.detach().clone());
  d.insert("check/inputs", inputs);
  d.insert("check/targets", targets);
  auto bytes = torch::pickle_save(c10::IValue(d));
  write_file_atomic(path, std::string(bytes.begin(), bytes.end()));
  return {{"weights", path}, {"loss", loss}};
}

// Times one phase's warmup + timed steps (phase 2 crosses the transition in its warmup) and returns its
// figures: speed, spread, MFU against `peak`, memory and state bytes.
nlohmann::json time_phase(const BenchOptions& o, Trainer& t, bool lora, double peak) {
  const Runtime& rt = t.runtime();
  const ModelOptions& m = t.model()->options();
  // Matmul parameters (the tied head counts; the embedding lookups do not), adapters, attention.
  int64_t n_matmul = 0;
  for (auto& [n, p] : named_params(*t.model()))
    if (p.dim() == 2 && !t.model()->is_lookup(n)) n_matmul += p.numel();
  const double attn = 12.0 * m.n_layer * m.d_model * m.block_size;  // fwd + bwd, per token
  rt.reset_device_peak();
  PhaseTimes times;
  double first_loss = 0;
  std::unique_ptr<CpuAllocatorPeak> cpu_peak;  // over the timed steps: the transition is in the warmup
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profile;
  const bool cuda_profile = o.cuda_profile == (lora ? "lora" : "full");
  for (int64_t i = 0; i < o.warmup_steps + o.steps; ++i) {
    // Both take the thread's PROFILER_STATE: the allocator's peak is not measured under --profile.
    if (i == o.warmup_steps && o.profile.empty()) cpu_peak = std::make_unique<CpuAllocatorPeak>();
    if (i == o.warmup_steps && !o.profile.empty())  // the timed steps only (profiling slows them)
      profile = std::make_unique<torch::autograd::profiler::RecordProfile>(o.profile + (lora ? "-lora" : "-full") +
                                                                            ".trace.json");
    rt.synchronize();
    if (i == o.warmup_steps && cuda_profile) cuda_profiler(true);
    const double t0 = now_seconds();
    StepResult r = t.train_step();
    rt.synchronize();  // on CUDA the step's last kernels may still be queued
    if (i == 0) first_loss = r.loss;
    if (i >= o.warmup_steps) times.step_seconds.push_back(now_seconds() - t0);
  }
  if (cuda_profile) cuda_profiler(false);
  profile.reset();
  const double step_peak_mb = cpu_peak ? static_cast<double>(cpu_peak->peak_bytes()) / 1048576.0 : 0.0;
  cpu_peak.reset();
  TORCH_CHECK(t.in_lora_phase() == lora, "bench: phase bookkeeping");
  const double med = times.median();
  double flops_per_token = lora ? 4.0 * n_matmul + 6.0 * count_lora_params(t.lora_params()) + attn
                                : 6.0 * n_matmul + attn;
  const double tok_s = t.tokens_per_step() / med;
  int64_t grads = 0;
  for (auto& [n, p] : t.optimizer().params()) grads += p.numel() * 4;
  return {{"phase", lora ? "lora" : "full"},
          {"first_step_loss", first_loss},
          {"tokens_per_s", tok_s},
          {"step_s_median", med},
          {"step_s_p10", times.quantile(0.1)},
          {"step_s_p90", times.quantile(0.9)},
          {"step_s_min", times.quantile(0.0)},
          {"step_s_max", times.quantile(1.0)},
          {"flops_per_token", flops_per_token},
          {"mfu", tok_s * flops_per_token / peak},
          {"peak_rss_mb", peak_rss_mb()},
          // null with --profile, whose profiler takes the allocator's reporting hook
          {"cpu_step_peak_mb", o.profile.empty() ? nlohmann::json(step_peak_mb) : nlohmann::json()},
          {"gpu_peak_mb", static_cast<double>(rt.device_peak_bytes()) / 1048576.0},
          {"rss_mb", current_rss_mb()},
          {"state_bytes",
           {{"weights", bytes_of(base_params(*t.model()))},
            {"adapters", lora ? bytes_of(t.lora_params().named()) : 0},
            {"gradients", grads},
            {"optimizer", t.optimizer().state_bytes()}}}};
}

void print_bench_table(const nlohmann::json& result, const ModelOptions& m, const Runtime& rt, const std::string& where,
                       double peak) {
  std::printf("\nmodel: %lld layers, d_model %lld, block %lld, vocab %lld; %lld tokens a step; %s, %s%s\n",
              (long long)m.n_layer, (long long)m.d_model, (long long)m.block_size, (long long)m.vocab_size,
              (long long)result["tokens_per_step"].get<int64_t>(), rt.bf16_autocast ? "bf16 autocast" : "f32", where.c_str(),
              m.activation_checkpointing ? "; activation checkpointing" : "");
  std::printf("measured matmul peak: %.0f GFLOP/s\n\n", peak / 1e9);
  std::printf("%-6s %10s %12s %18s %7s %10s %10s %10s %12s %12s%s\n", "phase", "tok/s", "step median", "step p10-p90 (s)",
              "MFU", "peak RSS", "step peak", "weights", "grads", "optimizer", rt.device.is_cuda() ? "   GPU peak" : "");
  for (const auto& ph : result["phases"]) {
    const auto& sb = ph["state_bytes"];
    std::printf("%-6s %10.0f %11.3fs %8.3f-%-9.3f %6.1f%% %8.0fMB %8.0fMB %8.1fMB %10.1fMB %10.1fMB",
                ph["phase"].get<std::string>().c_str(), ph["tokens_per_s"].get<double>(), ph["step_s_median"].get<double>(),
                ph["step_s_p10"].get<double>(), ph["step_s_p90"].get<double>(), 100 * ph["mfu"].get<double>(),
                ph["peak_rss_mb"].get<double>(), ph["cpu_step_peak_mb"].is_null() ? 0.0 : ph["cpu_step_peak_mb"].get<double>(),
                (sb["weights"].get<double>() + sb["adapters"].get<double>()) / 1048576.0,
                sb["gradients"].get<double>() / 1048576.0, sb["optimizer"].get<double>() / 1048576.0);
    if (rt.device.is_cuda()) std::printf(" %9.0fMB", ph["gpu_peak_mb"].get<double>());
    std::printf("\n");
  }
  std::printf("LoRA step time / full step time: %.2f\n", result["lora_step_time_ratio"].get<double>());
}

}  // namespace

nlohmann::json run_bench(const BenchOptions& o) {
  // A directory of its own (mkdtemp makes a new one or fails), so that the cleanup deletes nothing else.
  std::string pattern = (fs::temp_directory_path() / "lt-bench-XXXXXX").string();
  if (!::mkdtemp(pattern.data())) throw UserError("bench: could not make a temporary directory " + pattern + ": " + std::strerror(errno));
  const fs::path tmp = pattern;
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      remove_tree(p.string());
    }
  } cleanup{tmp};

  auto job = make_bench_job(o, tmp);
  auto* t = dynamic_cast<Trainer*>(job.get());
  const Runtime& rt = t->runtime();
  const ModelOptions& m = t->model()->options();
  if (!o.cuda_profile.empty() && !rt.device.is_cuda())
    throw UserError("bench --cuda-profile records CUDA kernels, but this run is on " + rt.describe() +
                    ": use it on a CUDA device (runtime/device=cuda)");

  const std::string where = rt.device.is_cuda() ? rt.device.str() : std::to_string(rt.threads) + " threads";
  std::printf("bench: measuring the %s matmul peak (%s)...\n", rt.bf16_autocast ? "bf16" : "f32", where.c_str());
  std::fflush(stdout);
  double peak = 0;
  const std::vector<int64_t> sizes = rt.device.is_cuda() ? std::vector<int64_t>{4096, 8192} : std::vector<int64_t>{1024, 2048};
  for (int64_t n : sizes) peak = std::max(peak, measure_matmul_peak(n, rt.bf16_autocast, rt));

  const nlohmann::json check = o.weights_out.empty() ? nlohmann::json(nullptr) : write_first_batch_check(*t, o.weights_out);
  nlohmann::json result = {{"config", o.config_path},
                           {"model", {{"n_layers", m.n_layer}, {"d_model", m.d_model}, {"n_heads", m.n_head},
                                      {"block_size", m.block_size}, {"vocab_size", m.vocab_size},
                                      {"activation_checkpointing", m.activation_checkpointing}}},
                           {"tokens_per_step", t->tokens_per_step()},
                           {"threads", rt.threads},
                           {"precision", rt.bf16_autocast ? "bf16 autocast" : "f32"},
                           {"device", rt.device.str()},
                           {"torch_version", compat::torch_version()},
                           {"matmul_peak_gflops", peak / 1e9},
                           {"first_batch_check", check},
                           {"resolved_config", t->config().to_json()}};
  for (const bool lora : {false, true}) result["phases"].push_back(time_phase(o, *t, lora, peak));
  const auto& p1 = result["phases"][0];
  const auto& p2 = result["phases"][1];
  result["lora_step_time_ratio"] = p2["step_s_median"].get<double>() / p1["step_s_median"].get<double>();
  print_bench_table(result, m, rt, where, peak);
  write_file_atomic(o.out_json, result.dump(2) + "\n");
  std::printf("wrote %s\n", o.out_json.c_str());
  return result;
}

}  // namespace lt
