#include "lora_trainer/models/model.hpp"

#include <algorithm>

#include <cctype>
#include <cstdio>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/options.hpp"
#include "lora_trainer/models/gpt2.hpp"
#include "lora_trainer/models/llama.hpp"
#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/kernels/cross_entropy.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

// architecture/family's values, in the order of ModelFamily.
const std::vector<std::string>& model_family_names() {
  static const std::vector<std::string> names = {"gpt2", "llama"};
  return names;
}

ModelFamily parse_model_family(const std::string& s) {
  return enum_named<ModelFamily>(model_family_names(), s, "architecture/family");
}

const char* to_string(ModelFamily f) { return enum_name(model_family_names(), f).c_str(); }

// architecture/activation's values, in the order of ModelOptions::Activation.
static const std::vector<std::string>& activation_names() {
  static const std::vector<std::string> names = {"gelu", "gelu_tanh", "silu"};
  return names;
}

const char* activation_name(ModelOptions::Activation a) { return enum_name(activation_names(), a).c_str(); }

// architecture/rope_scaling's values, in the order of RopeScaling::Kind.
static const std::vector<std::string>& rope_scaling_names() {
  static const std::vector<std::string> names = {"none", "linear", "llama3"};
  return names;
}

const char* rope_scaling_name(RopeScaling::Kind kind) { return enum_name(rope_scaling_names(), kind).c_str(); }

// architecture/* and training/activation_checkpointing, each bound to the ModelOptions field it sets.
// runtime/attention and runtime/loss are the runtime's keys (RuntimeOptions), taken by from_config.
static const OptionGroup<ModelOptions>& model_options() {
  using O = ModelOptions;
  static const auto g =
      OptionGroup<O>()
          .add("architecture/block_size", OptType::Int, 256, "context length T in tokens",
               &O::block_size, check_positive())
          .add("architecture/n_layers", OptType::Int, 6, "transformer blocks",
               &O::n_layer, check_positive())
          .add("architecture/n_heads", OptType::Int, 6, "attention heads (must divide d_model)",
               &O::n_head, check_positive())
          .add("architecture/d_model", OptType::Int, 384, "residual width C",
               &O::d_model, check_positive())
          .add("architecture/vocab_size", OptType::Int, 50257, "vocabulary size V (>= the tokenizer's)",
               &O::vocab_size, check_positive())
          .add("architecture/dropout", OptType::Float, 0.0, "dropout probability",
               &O::dropout, check_range(0, 0.9))
          .add("architecture/activation", OptType::String, "gelu",
               "the MLP's activation: gelu (exact, erf), gelu_tanh (the tanh approximation of GPT-2 and HF's gelu_new) "
               "or silu (llama only: the gate of SwiGLU, what Llama, Qwen2 and Mistral use)",
               [](O& o, const json& v) {
                 o.activation = enum_named<O::Activation>(activation_names(), v.get<std::string>(), "architecture/activation");
               },
               check_one_of(activation_names()))
          .add("architecture/family", OptType::String, "gpt2",
               "model family: gpt2 (learned positions, LayerNorm, GELU MLP, tied head; GPT-2's parameter names) or llama "
               "(Llama/Qwen2/Mistral: rotary positions, RMSNorm, gated MLP, grouped-query attention; HF's parameter names)",
               [](O& o, const json& v) { o.family = parse_model_family(v.get<std::string>()); },
               check_one_of(model_family_names()))
          .add("architecture/d_ff", OptType::Int, -1, "the MLP's hidden width; -1 = 4 x d_model",
               &O::d_ff, check_positive_or_minus_one())
          .add("architecture/n_kv_heads", OptType::Int, -1,
               "llama: key/value heads of grouped-query attention (must divide n_heads); -1 = n_heads",
               &O::n_kv_head,
               check_positive_or_minus_one())
          .add("architecture/norm_eps", OptType::Float, 1e-5, "epsilon of the layer norms (gpt2) or RMS norms (llama)",
               &O::norm_eps,
               check_positive())
          .add("architecture/rope_theta", OptType::Float, 10000.0, "llama: base of the rotary position angles",
               &O::rope_theta,
               check_positive())
          .add("architecture/rope_scaling", OptType::String, "none",
               "llama: rescaling of the rotary frequencies: none, linear (divided by rope_factor) or llama3 (Llama 3.1 and "
               "3.2's, by wavelength: rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_context)",
               [](O& o, const json& v) {
                 o.rope_scaling.kind =
                     enum_named<RopeScaling::Kind>(rope_scaling_names(), v.get<std::string>(), "architecture/rope_scaling");
               },
               check_one_of(rope_scaling_names()))
          .add("architecture/rope_factor", OptType::Float, 8.0, "llama, rope_scaling linear or llama3: the factor",
               [](O& o, const json& v) { o.rope_scaling.factor = v.get<double>(); }, check_positive())
          .add("architecture/rope_low_freq_factor", OptType::Float, 1.0, "llama, rope_scaling llama3: low_freq_factor",
               [](O& o, const json& v) { o.rope_scaling.low_freq_factor = v.get<double>(); },
               check_positive())
          .add("architecture/rope_high_freq_factor", OptType::Float, 4.0, "llama, rope_scaling llama3: high_freq_factor",
               [](O& o, const json& v) { o.rope_scaling.high_freq_factor = v.get<double>(); },
               check_positive())
          .add("architecture/rope_original_context", OptType::Int, 8192,
               "llama, rope_scaling llama3: original_max_position_embeddings, the context of pretraining",
               [](O& o, const json& v) { o.rope_scaling.original_context = v.get<int64_t>(); }, check_positive())
          .add("architecture/tie_embeddings", OptType::Bool, true,
               "the output head is the token embedding; false: a separate lm_head (llama only)",
               &O::tie_embeddings)
          .add("architecture/qkv_bias", OptType::Bool, false, "llama: biases on q_proj, k_proj and v_proj (Qwen2 has them)",
               &O::qkv_bias)
          .add("training/activation_checkpointing", OptType::Bool, false,
               "recompute each transformer block's activations in the backward instead of keeping them: less memory for "
               "one more forward of the blocks a step; the same results (bit-identical), both phases",
               &O::activation_checkpointing);
  return g;
}

void add_model_options(ConfigSchema& s) { model_options().declare(s); }

Config model_config() {
  ConfigSchema s;
  add_runtime_options(s);
  add_model_options(s);
  return Config(s);
}

ModelOptions ModelOptions::from_config(const Config& cfg) {
  ModelOptions o = model_options().read(cfg);
  const RuntimeOptions runtime = RuntimeOptions::from_config(cfg);
  o.attention = runtime.attention;
  o.loss = runtime.loss;
  if (o.attention == Attention::Fused && !fused_attention_available())
    throw UserError(std::string("runtime/attention=fused needs LibTorch 2.0 or newer (this build has ") +
                    compat::torch_version() + "); use runtime/attention=auto or manual");
  o.validate();
  return o;
}

void ModelOptions::validate() const {
  auto n = [](int64_t v) { return std::to_string(v); };
  if (d_model % n_head != 0)
    throw UserError("architecture/d_model (" + n(d_model) + ") must be divisible by architecture/n_heads (" + n(n_head) + ")");
  if (family == ModelFamily::Gpt2) {
    const char* llama_only = kv_heads() != n_head ? "architecture/n_kv_heads"
                             : !tie_embeddings   ? "architecture/tie_embeddings=false"
                             : qkv_bias          ? "architecture/qkv_bias=true"
                             : activation == Activation::Silu ? "architecture/activation=silu"
                             : rope_scaling.kind != RopeScaling::Kind::None ? "architecture/rope_scaling"
                                                              : nullptr;
    if (llama_only)
      throw UserError(std::string(llama_only) + " is a llama-family setting; this model is architecture/family=gpt2. "
                      "Set architecture/family=llama, or leave it at its default");
    return;
  }
  if (n_head % kv_heads() != 0)
    throw UserError("architecture/n_kv_heads (" + n(kv_heads()) + ") must divide architecture/n_heads (" + n(n_head) + ")");
  if (rope_scaling.kind == RopeScaling::Kind::Llama3 && rope_scaling.high_freq_factor <= rope_scaling.low_freq_factor)
    throw UserError("architecture/rope_high_freq_factor (" + std::to_string(rope_scaling.high_freq_factor) +
                    ") must exceed architecture/rope_low_freq_factor (" + std::to_string(rope_scaling.low_freq_factor) + ")");
  if (head_dim() % 2 != 0)
    throw UserError("the llama family's rotary embeddings need an even head size; d_model / n_heads is " + n(head_dim()));
}

bool ModelOptions::fused_attention_on(const torch::Device& device) const {
  if (attention == Attention::Auto) return device.is_cuda() && fused_attention_available();
  return attention == Attention::Fused;
}

bool ModelOptions::fused_loss_on(const torch::Device& device) const {
  // auto: fused on the CPU, and on CUDA where the build has the kernels (1.20x the step of GPT-2 124M
  // on an H200, 6 GB less GPU memory: docs/performance.md); LibTorch's loss on CUDA without them.
  if (loss == Loss::Auto || loss == Loss::Chunked) return !device.is_cuda() || cuda_loss_kernels_built();
  return loss == Loss::Fused;
}

bool ModelOptions::chunked_loss_on(const torch::Device& device) const {
  // auto: on the CPU (kernels/head_loss.hpp; docs/performance.md); on CUDA where asked for.
  return loss == Loss::Chunked || (loss == Loss::Auto && !device.is_cuda());
}

// Settings from a file (an HF config.json with vocab_size 10^12) are refused before anything is
// allocated: the model's parameters are allocated in float32 when it is made (untouched pages until a
// job draws, loads or places them), so a single tensor larger than this machine's memory cannot be made
// at all, whatever the job then keeps (NF4, sharded). Whether the job fits is its memory plan's question
// (training/memory_plan.hpp), asked before the weights are touched. Sizes in double: no overflow.
static void check_model_fits(const ModelOptions& o) {
  const double C = double(o.d_model), V = double(o.vocab_size), F = o.d_ff > 0 ? double(o.d_ff) : 4 * C;
  const double largest = 4 * std::max({V * C, C * F, C * C, double(o.block_size) * C});
  const double memory = double(machine_memory());
  const double per_layer = C * C * 4 + C * F * 3 + 8 * C;  // at most (kv heads <= heads; llama's 3 MLP matrices)
  const double all = 4 * (2 * V * C + double(o.n_layer) * per_layer + double(o.block_size) * C);
  if (largest > memory) {
    char b[360];
    std::snprintf(b, sizeof b,
                  "the model as configured (architecture/vocab_size %lld, d_model %lld, d_ff %lld, block_size %lld) has a "
                  "single tensor of %.3g GB in float32: more than this machine's %.3g GB of memory, in any form. Check "
                  "these settings (or the config.json they came from)",
                  (long long)o.vocab_size, (long long)o.d_model, (long long)(o.d_ff > 0 ? o.d_ff : 4 * o.d_model),
                  (long long)o.block_size, largest / 1e9, memory / 1e9);
    throw UserError(b);
  }
  if (all > double(int64_t{1} << 47)) {  // beyond a process's address space (128 TiB)
    char b[300];
    std::snprintf(b, sizeof b,
                  "the model as configured (architecture/n_layers %lld, d_model %lld, vocab_size %lld) has %.3g GB of "
                  "parameters in float32, more memory than a process can address: check these settings (or the config.json "
                  "they came from)",
                  (long long)o.n_layer, (long long)o.d_model, (long long)o.vocab_size, all / 1e9);
    throw UserError(b);
  }
}

CausalLM make_model(const ModelOptions& o) {
  check_model_fits(o);
  switch (o.family) {
    case ModelFamily::Gpt2: return GPT(o).ptr();
    case ModelFamily::Llama: return Llama(o).ptr();
  }
  throw std::logic_error("make_model: unknown family");
}

void CausalLMImpl::set_block_shards(std::vector<std::shared_ptr<BlockShard>> shards) {
  TORCH_CHECK(shards.empty() || static_cast<int64_t>(shards.size()) == opts_.n_layer, "set_block_shards: ", shards.size(),
              " shards for ", opts_.n_layer, " blocks");
  block_shards_ = std::move(shards);
  // Each block's neighbours in the model's order, whose gathers its forward and backward start early.
  for (size_t i = 0; i < block_shards_.size(); ++i) {
    block_shards_[i]->next = i + 1 < block_shards_.size() ? block_shards_[i + 1].get() : nullptr;
    block_shards_[i]->previous = i > 0 ? block_shards_[i - 1].get() : nullptr;
  }
}

int64_t CausalLMImpl::block_number(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return -1;
  size_t end = prefix.size();
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == prefix.size() || end >= name.size() || name[end] != '.') return -1;
  return std::stoll(name.substr(prefix.size(), end - prefix.size()));
}

int64_t count_targets(const torch::Tensor& targets) { return targets.ge(0).sum().item<int64_t>(); }

NamedTensors named_params(torch::nn::Module& m) {
  NamedTensors out;
  for (auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

NamedTensors base_params(torch::nn::Module& m) {
  NamedTensors out;
  for (auto& p : m.named_parameters())
    if (!is_adapter_param(p.key())) out.emplace_back(p.key(), p.value());
  return out;
}

static bool same_setting(const nlohmann::json& a, const nlohmann::json& b) {
  return a == b || (a.is_number() && b.is_number() && a.get<double>() == b.get<double>());
}

std::vector<std::pair<std::string, nlohmann::json>> differing_architecture(const Config& cfg,
                                                                           const std::vector<std::string>& settings) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  for (const auto& setting : settings) {
    const std::string key = setting.substr(0, setting.find('='));
    if (key == "architecture/block_size") continue;
    Config theirs = cfg;
    theirs.apply_override(setting);
    if (!same_setting(theirs.get(key), cfg.get(key))) out.emplace_back(setting, cfg.get(key));
  }
  return out;
}

void check_same_computation(const Config& cfg, const nlohmann::json& saved, const std::string& source) {
  for (const char* key : {"family", "activation", "n_heads", "norm_eps", "rope_theta", "rope_scaling", "rope_factor",
                          "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context"}) {
    const std::string path = std::string("architecture/") + key;
    const nlohmann::json theirs = saved.contains(key) ? saved[key] : cfg.schema().find(path)->default_value;
    const nlohmann::json& ours = cfg.get(path);
    if (same_setting(theirs, ours)) continue;
    auto text = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
    throw UserError(source + " holds weights of a model with " + path + "=" + text(theirs) + "; this job has " + text(ours) +
                    ". Set " + path + "=" + text(theirs) + " (import-hf prints the architecture a job needs)");
  }
}

}  // namespace lt
