#include "lora_trainer/peft/lora.hpp"

#include <algorithm>
#include <cmath>

#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

static std::string strip_weight(const std::string& base_name) {
  const std::string suffix = ".weight";
  if (base_name.size() > suffix.size() &&
      base_name.compare(base_name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return base_name.substr(0, base_name.size() - suffix.size());
  return base_name;
}

std::string LoraParams::a_name(const std::string& base_name) { return strip_weight(base_name) + ".lora_A"; }
std::string LoraParams::b_name(const std::string& base_name) { return strip_weight(base_name) + ".lora_B"; }
std::string LoraParams::magnitude_name(const std::string& base_name) {
  return strip_weight(base_name) + ".lora_magnitude";
}

NamedTensors LoraParams::named() const {
  TORCH_CHECK(magnitude.empty() || magnitude.size() == names.size(), "LoraParams: ", magnitude.size(),
              " DoRA magnitudes for ", names.size(), " adapters");
  NamedTensors out;
  for (size_t i = 0; i < names.size(); ++i) {
    out.emplace_back(a_name(names[i]), A[i]);
    out.emplace_back(b_name(names[i]), B[i]);
    if (dora()) out.emplace_back(magnitude_name(names[i]), magnitude[i]);
  }
  return out;
}

std::vector<bool> param_filter(const NamedTensors& params, const std::vector<std::string>& target_modules) {
  if (target_modules.empty())
    throw LoraSettingError("target_modules", "the list is empty: name at least one parameter substring");
  std::vector<bool> mask(params.size(), false);
  std::vector<bool> used(target_modules.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].second.dim() != 2) continue;
    for (size_t t = 0; t < target_modules.size(); ++t) {
      if (params[i].first.find(target_modules[t]) != std::string::npos) {
        mask[i] = true;
        used[t] = true;
      }
    }
  }
  for (size_t t = 0; t < target_modules.size(); ++t) {
    if (used[t]) continue;
    std::vector<std::string> names;
    for (const auto& p : params)
      if (p.second.dim() == 2) names.push_back(p.first);
    throw LoraSettingError("target_modules", "\"" + target_modules[t] +
                                                 "\" matches no 2-D parameter. Targets are substrings of these names: " + join(names));
  }
  return mask;
}

std::vector<std::string> expand_target_modules(torch::nn::Module& root, const std::vector<std::string>& targets) {
  std::vector<std::string> out;
  for (const auto& t : targets) {
    if (t != kAllLinear) {
      out.push_back(t);
      continue;
    }
    for (const auto& w : adaptable_weights(root))
      if (w != "lm_head.weight") out.push_back(w);
  }
  return out;
}

const std::vector<std::string>& lora_init_names() {
  static const std::vector<std::string> names = {"gaussian", "kaiming_uniform"};  // in LoraInit's order
  return names;
}

LoraInit parse_lora_init(const std::string& s) {
  if (auto value = enum_from_name<LoraInit>(lora_init_names(), s)) return *value;
  throw LoraSettingError("init", "\"" + s + "\" is not one of " + join(lora_init_names()));
}

const char* to_string(LoraInit init) { return enum_name(lora_init_names(), init).c_str(); }

// A parameter's name, and its module's (the name without its last part), each match `entry` when equal
// to it or ending in "." + entry.
static bool names_module_or_param(const std::string& param, const std::string& entry) {
  auto match = [&](const std::string& name) {
    return name == entry || (name.size() > entry.size() && name.compare(name.size() - entry.size(), entry.size(), entry) == 0 &&
                             name[name.size() - entry.size() - 1] == '.');
  };
  const size_t dot = param.rfind('.');
  return match(param) || (dot != std::string::npos && match(param.substr(0, dot)));
}

std::vector<bool> modules_to_save_filter(const NamedTensors& params, const std::vector<std::string>& modules,
                                         const std::vector<bool>& lora_mask) {
  TORCH_CHECK(params.size() == lora_mask.size(), "modules_to_save_filter: mask size differs from params");
  std::vector<bool> mask(params.size(), false);
  for (const auto& entry : modules) {
    bool used = false;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!names_module_or_param(params[i].first, entry)) continue;
      if (lora_mask[i])
        throw LoraSettingError("modules_to_save", "\"" + entry + "\" selects " + params[i].first +
                                                      ", which target_modules already gives an adapter; a weight either "
                                                      "trains in full or through an adapter. Remove it from one of the two lists");
      mask[i] = used = true;
    }
    if (used) continue;
    // The modules, once each, with every layer index written as * (h.*.ln_1): short for any depth.
    std::vector<std::string> modules;
    for (const auto& p : params) {
      std::string m = p.first.substr(0, p.first.rfind('.')), starred;
      for (size_t at = 0; at <= m.size();) {
        size_t dot = std::min(m.find('.', at), m.size());
        std::string part = m.substr(at, dot - at);
        bool index = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
        starred += (at ? "." : "") + (index ? std::string("*") : part);
        at = dot + 1;
      }
      if (std::find(modules.begin(), modules.end(), starred) == modules.end()) modules.push_back(starred);
    }
    throw LoraSettingError("modules_to_save", "\"" + entry + "\" matches no module or parameter. An entry is a name, or "
                                              "a suffix after a '.', of a module (* stands for each layer's index) or of "
                                              "one of its parameters (.weight, .bias): " + join(modules));
  }
  return mask;
}

LoraParams inject_lora_params(const NamedTensors& params, const std::vector<bool>& mask, int64_t rank,
                              torch::Generator generator, LoraInit init, bool dora) {
  TORCH_CHECK(params.size() == mask.size(), "inject_lora_params: mask size differs from params");
  if (rank <= 0) throw LoraSettingError("rank", "must be > 0, got " + std::to_string(rank));
  LoraParams out;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!mask[i]) continue;
    const auto& W = params[i].second;  // (out, in)
    int64_t out_f = W.size(0), in_f = W.size(1);
    if (rank > std::min(in_f, out_f))
      throw LoraSettingError("rank", std::to_string(rank) + " exceeds the size of " +
                      params[i].first + " (" + std::to_string(out_f) + " x " + std::to_string(in_f) + ")");
    auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(W.device());
    torch::Tensor A = torch::empty({in_f, rank}, opts.device(torch::kCPU));
    // Drawn on the CPU: the same values on any device.
    if (init == LoraInit::Gaussian) {
      A.normal_(0.0, 1.0 / static_cast<double>(rank), generator);
    } else {
      const double bound = 1.0 / std::sqrt(static_cast<double>(in_f));  // kaiming_uniform_(a=sqrt(5)), fan_in = in
      A.uniform_(-bound, bound, generator);
    }
    out.names.push_back(params[i].first);
    out.A.push_back(A.to(W.device()));
    out.B.push_back(torch::zeros({rank, out_f}, opts));
    // The norm the forward divides by, at B = 0: m / ||W|| is then exactly 1.
    if (dora) out.magnitude.push_back(dora_weight_norm(W, out.A.back(), out.B.back(), 1.0));
  }
  return out;
}

double lora_scale(double alpha, int64_t rank, bool rslora) {
  const double r = static_cast<double>(rank);
  return alpha / (rslora ? std::sqrt(r) : r);
}

namespace {
// Autocast off on `device` for a scope: DoRA's norm is computed in f32 whatever the forward runs in.
class AutocastOff {
 public:
  explicit AutocastOff(c10::DeviceType device) : device_(device), prev_(compat::autocast_enabled(device)) {
    compat::set_autocast_enabled(device_, false);
  }
  ~AutocastOff() { compat::set_autocast_enabled(device_, prev_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_;
};

// W + scale (A B)^T in f32, (out, in): the one expression the merge and DoRA's norm both use.
torch::Tensor merged_f32(const torch::Tensor& W, const torch::Tensor& A, const torch::Tensor& B, double scale) {
  auto delta = torch::mm(A.to(torch::kFloat32), B.to(torch::kFloat32)).t();  // (out, in)
  return W.to(torch::kFloat32) + scale * delta;
}
}  // namespace

torch::Tensor dora_weight_norm(const torch::Tensor& W, const torch::Tensor& A, const torch::Tensor& B, double scale) {
  torch::NoGradGuard ng;
  AutocastOff f32(W.device().type());
  return merged_f32(W.detach(), A.detach(), B.detach(), scale).norm(2, {1});
}

void check_adapter_shapes(const std::string& weight, const torch::Tensor& W, const torch::Tensor& A,
                          const torch::Tensor& B, int64_t rank) {
  const bool ok = W.dim() == 2 && A.dim() == 2 && B.dim() == 2 && A.size(0) == W.size(1) && A.size(1) == rank &&
                  B.size(0) == rank && B.size(1) == W.size(0);
  if (ok) return;
  const int64_t in = W.dim() == 2 ? W.size(1) : -1, out = W.dim() == 2 ? W.size(0) : -1;
  const std::string tail = ". The checkpoint is damaged or hand-edited; " + use_another_checkpoint();
  const std::string w = (weight.empty() ? std::string("a weight") : weight) + " " + shape_text(W.sizes().vec());
  // A and B of one rank that fit W: the metadata's rank is what contradicts them.
  if (A.dim() == 2 && B.dim() == 2 && A.size(0) == in && B.size(1) == out && A.size(1) == B.size(0))
    throw UserError("the adapter of " + w + " has A " + shape_text(A.sizes().vec()) + ", B " + shape_text(B.sizes().vec()) +
                    " (rank " + std::to_string(A.size(1)) + "), not the A (" + std::to_string(in) + ", " + std::to_string(rank) +
                    "), B (" + std::to_string(rank) + ", " + std::to_string(out) + ") of rank " + std::to_string(rank) +
                    " that its metadata (lora.rank) gives: the metadata contradicts the tensors, and merging would scale by "
                    "the wrong alpha / rank" + tail);
  // Else each tensor that does not fit W, by its name, with what it should be (and whether it is that transposed).
  std::vector<std::string> problems;
  auto check = [&](const std::string& name, const torch::Tensor& t, std::vector<int64_t> want) {
    const std::vector<int64_t> got = t.sizes().vec();
    if (got == want) return;
    const bool transposed = got.size() == 2 && got[0] == want[1] && got[1] == want[0];
    problems.push_back(name + " has shape " + shape_text(got) + ", expected " + shape_text(want) + (transposed ? " (transposed)" : ""));
  };
  check(weight.empty() ? "A" : "params/" + LoraParams::a_name(weight), A, {in, rank});
  check(weight.empty() ? "B" : "params/" + LoraParams::b_name(weight), B, {rank, out});
  throw UserError("the adapter of " + w + " does not fit it: " + join(problems, "; ") + " (an adapter of rank r is A (in, r) "
                  "and B (r, out) for a weight (out, in))" + tail);
}

torch::Tensor merge_lora_params(const torch::Tensor& base, const torch::Tensor& A, const torch::Tensor& B,
                                double alpha, int64_t rank, bool rslora, const torch::Tensor& magnitude) {
  check_adapter_shapes("", base, A, B, rank);
  torch::NoGradGuard ng;
  auto merged = merged_f32(base, A, B, lora_scale(alpha, rank, rslora));
  if (magnitude.defined()) {  // DoRA: each row rescaled to its magnitude (PEFT's merge)
    if (magnitude.dim() != 1 || magnitude.size(0) != base.size(0))
      throw UserError("a DoRA magnitude of shape " + shape_text(magnitude.sizes().vec()) + " for a weight of shape " +
                      shape_text(base.sizes().vec()) + ": one value per output feature (row) is needed. The checkpoint "
                      "is damaged or hand-edited; " + use_another_checkpoint());
    merged = merged * (magnitude.to(torch::kFloat32) / merged.norm(2, {1})).unsqueeze(1);
  }
  return merged.to(base.dtype());
}

NamedTensors merge_lora_params(const NamedTensors& base, const LoraParams& lora, double alpha, int64_t rank,
                               bool rslora) {
  NamedTensors out;
  for (const auto& [name, t] : base) {
    auto it = std::find(lora.names.begin(), lora.names.end(), name);
    if (it == lora.names.end()) {
      out.emplace_back(name, t);
    } else {
      size_t i = static_cast<size_t>(it - lora.names.begin());
      check_adapter_shapes(name, t, lora.A[i], lora.B[i], rank);
      out.emplace_back(name, merge_lora_params(t, lora.A[i], lora.B[i], alpha, rank, rslora,
                                               lora.dora() ? lora.magnitude[i] : torch::Tensor()));
    }
  }
  return out;
}

bool is_lora_param(const std::string& name) {
  return ends_with(name, ".lora_A") || ends_with(name, ".lora_B") || ends_with(name, ".lora_magnitude");
}

bool is_adapter_param(const std::string& name) {
  return is_lora_param(name) || ends_with(name, ".trainable_tokens_delta");
}

double lora_plus_lr_scale(const std::string& name, double lr_ratio) {
  return ends_with(name, ".lora_B") || ends_with(name, ".lora_magnitude") ? lr_ratio : 1.0;
}

int64_t count_lora_params(const LoraParams& lora) {
  int64_t n = 0;
  for (size_t i = 0; i < lora.names.size(); ++i)
    n += lora.A[i].numel() + lora.B[i].numel() + (lora.dora() ? lora.magnitude[i].numel() : 0);
  return n;
}

static void for_each_adaptable(torch::nn::Module& root,
                               const std::function<void(const std::string&, LoraAdaptable&)>& fn) {
  for (const auto& item : root.named_modules()) {
    auto* adaptable = dynamic_cast<LoraAdaptable*>(item.value().get());
    if (adaptable) fn(item.key(), *adaptable);
  }
}

// The name of the weight of the adaptable module `module_name`.
static std::string weight_of(const std::string& module_name) { return module_name.empty() ? "weight" : module_name + ".weight"; }

std::vector<std::string> adaptable_weights(torch::nn::Module& root) {
  std::vector<std::string> out;
  for_each_adaptable(root, [&](const std::string& module_name, LoraAdaptable&) { out.push_back(weight_of(module_name)); });
  return out;
}

std::map<std::string, LoraAdaptable*> adaptable_layers(torch::nn::Module& root) {
  std::map<std::string, LoraAdaptable*> out;
  for_each_adaptable(root, [&](const std::string& module_name, LoraAdaptable& layer) { out[weight_of(module_name)] = &layer; });
  return out;
}

void check_lora_targets(torch::nn::Module& root, const NamedTensors& params, const std::vector<bool>& mask,
                        int64_t rank) {
  auto adaptable = adaptable_weights(root);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!mask[i]) continue;
    const auto& name = params[i].first;
    if (std::find(adaptable.begin(), adaptable.end(), name) == adaptable.end())
      throw LoraSettingError("target_modules", "selects " + name +
                      ", which is not a linear layer's weight and cannot take an adapter. Adaptable weights: " +
                      join(adaptable));
    const auto& W = params[i].second;
    if (rank > std::min(W.size(0), W.size(1)))
      throw LoraSettingError("rank", std::to_string(rank) + " exceeds the smaller side of " + name + " (" +
                      std::to_string(W.size(0)) + " x " + std::to_string(W.size(1)) + ")");
  }
}

void attach_lora(torch::nn::Module& root, const LoraParams& lora, double alpha, int64_t rank, bool rslora) {
  std::vector<bool> attached(lora.names.size(), false);
  for_each_adaptable(root, [&](const std::string& module_name, LoraAdaptable& layer) {
    std::string weight_name = weight_of(module_name);
    for (size_t i = 0; i < lora.names.size(); ++i) {
      if (lora.names[i] == weight_name) {
        layer.set_lora(lora.A[i], lora.B[i], lora_scale(alpha, rank, rslora),
                       lora.dora() ? lora.magnitude[i] : torch::Tensor());
        attached[i] = true;
      }
    }
  });
  for (size_t i = 0; i < lora.names.size(); ++i)
    TORCH_CHECK(attached[i], "attach_lora: no adaptable layer owns ", lora.names[i],
                " (only layers implementing LoraAdaptable can take adapters)");
}

LoraParams lora_params_of(torch::nn::Module& root) {
  LoraParams out;
  for (const auto& item : root.named_modules()) {
    if (!dynamic_cast<LoraAdaptable*>(item.value().get())) continue;
    const auto own = item.value()->named_parameters(/*recurse=*/false);
    const torch::Tensor* A = own.find("lora_A");
    if (!A) continue;
    const torch::Tensor* B = own.find("lora_B");
    const torch::Tensor* magnitude = own.find("lora_magnitude");
    TORCH_CHECK(B, "lora_params_of: ", item.key(), " has lora_A without lora_B");
    out.names.push_back(item.key().empty() ? "weight" : item.key() + ".weight");
    out.A.push_back(*A);
    out.B.push_back(*B);
    if (magnitude) out.magnitude.push_back(*magnitude);
  }
  TORCH_CHECK(out.magnitude.empty() || out.magnitude.size() == out.names.size(),
              "lora_params_of: DoRA magnitudes on some adapted layers only");
  return out;
}

void freeze_base(torch::nn::Module& root, const std::vector<std::string>& keep, const FrozenFormatOf& format_of) {
  auto kept = [&](const std::string& name) { return std::find(keep.begin(), keep.end(), name) != keep.end(); };
  std::vector<std::string> through_layer;  // the weights a layer's FrozenWeight stores
  for_each_adaptable(root, [&](const std::string& module_name, LoraAdaptable& layer) {
    const std::string weight = weight_of(module_name);
    if (kept(weight)) return;
    layer.freeze_weight(format_of(weight));
    through_layer.push_back(weight);
  });
  for (auto& item : root.named_parameters()) {
    const std::string& name = item.key();
    if (kept(name) || is_adapter_param(name)) continue;
    torch::Tensor& p = item.value();
    if (std::find(through_layer.begin(), through_layer.end(), name) == through_layer.end())
      p.set_data(p.detach().to(torch::kBFloat16));  // as Module::to casts a parameter
    p.requires_grad_(false);
  }
}

std::map<std::string, std::shared_ptr<FrozenWeight>> frozen_storages(torch::nn::Module& root) {
  std::map<std::string, std::shared_ptr<FrozenWeight>> out;
  for_each_adaptable(root, [&](const std::string& module_name, LoraAdaptable& layer) {
    auto storage = layer.frozen();
    if (storage && !storage->held_by_parameter()) out[weight_of(module_name)] = storage;
  });
  return out;
}

std::vector<std::shared_ptr<BlockShard>> shard_frozen_weights(torch::nn::Module& root,
                                                              const std::vector<std::vector<std::string>>& blocks,
                                                              Distributed& dist, const torch::Device& device) {
  const auto layers = adaptable_layers(root);
  std::map<std::string, torch::Tensor> params;
  for (auto& p : root.named_parameters()) params[p.key()] = p.value();
  std::vector<std::shared_ptr<BlockShard>> out;
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto block = std::make_shared<BlockShard>(dist, device, "block " + std::to_string(b));
    std::vector<std::shared_ptr<FrozenWeight>> sharded;
    for (const auto& name : blocks[b]) {
      LoraAdaptable* layer = layers.at(name);
      TORCH_CHECK(layer->frozen(), "shard_frozen_weights: ", name, " is not frozen");
      sharded.push_back(shard_weight(layer->frozen(), params.at(name), block));
      layer->set_frozen(sharded.back());
    }
    block->seal();
    for (auto& s : sharded) finish_sharding(*s);
    out.push_back(block);
  }
  return out;
}

void detach_lora(torch::nn::Module& root) {
  for_each_adaptable(root, [](const std::string&, LoraAdaptable& layer) { layer.set_lora({}, {}, 0.0, {}); });
}

std::string TrainableTokens::values_name(const std::string& base_name) {
  return strip_weight(base_name) + ".trainable_tokens_delta";
}

std::vector<std::string> token_embeddings(torch::nn::Module& root) {
  std::vector<std::string> out;
  for (const auto& item : root.named_modules())
    if (dynamic_cast<TokenRowsAdaptable*>(item.value().get()))
      out.push_back(item.key().empty() ? "weight" : item.key() + ".weight");
  return out;
}

std::string resolve_trainable_tokens(torch::nn::Module& root, const NamedTensors& params, const std::string& module,
                                     const std::vector<int64_t>& ids) {
  const auto embeddings = token_embeddings(root);
  TORCH_CHECK(!embeddings.empty(), "resolve_trainable_tokens: the model has no token embedding");
  std::string name = embeddings.front();
  if (!module.empty()) {
    name.clear();
    for (const auto& e : embeddings)
      if (names_module_or_param(e, module)) name = e;
    if (name.empty())
      throw LoraSettingError("trainable_token_indices", "\"" + module + "\" is not a token embedding of this model; "
                             "trainable tokens are rows of the token embedding: " + join(embeddings) +
                             " (or give a list of ids, which applies to it)");
  }
  if (ids.empty()) throw LoraSettingError("trainable_token_indices", "no token ids given: list the ids whose rows train");
  int64_t rows = -1;
  for (const auto& [n, t] : params)
    if (n == name) rows = t.size(0);
  TORCH_CHECK(rows > 0, "resolve_trainable_tokens: no parameter ", name);
  std::vector<int64_t> seen;
  for (int64_t id : ids) {
    if (id < 0 || id >= rows)
      throw LoraSettingError("trainable_token_indices", "token id " + std::to_string(id) + " is outside the vocabulary of " +
                                                           name + " (size " + std::to_string(rows) + ": ids 0 to " +
                                                           std::to_string(rows - 1) + ")");
    if (std::find(seen.begin(), seen.end(), id) != seen.end())
      throw LoraSettingError("trainable_token_indices", "token id " + std::to_string(id) + " is listed twice");
    seen.push_back(id);
  }
  return name;
}

static torch::Tensor ids_tensor(const std::vector<int64_t>& ids, const torch::Device& device) {
  return torch::tensor(ids, torch::kLong).to(device);
}

TrainableTokens make_trainable_tokens(const std::string& name, const torch::Tensor& weight, const std::vector<int64_t>& ids) {
  torch::NoGradGuard ng;
  TrainableTokens t;
  t.name = name;
  t.ids = ids;
  t.values = weight.detach().index_select(0, ids_tensor(ids, weight.device())).to(torch::kFloat32).clone();
  return t;
}

// Row ids and their values read from a file (a checkpoint's lora.trainable_tokens): each id a row of
// `rows`, one row of `width` values per id. Anything else would index out of bounds.
static void check_token_rows(const std::string& name, int64_t rows, int64_t width, const std::vector<int64_t>& ids,
                             const torch::Tensor& values) {
  for (int64_t id : ids)
    if (id < 0 || id >= rows)
      throw UserError("trainable token row " + std::to_string(id) + " of " + name + " is not a row of its " +
                      std::to_string(rows) + " (lora.trainable_tokens in the checkpoint's metadata.json). The checkpoint is "
                      "damaged or hand-edited; " + use_another_checkpoint());
  if (values.dim() != 2 || values.size(0) != static_cast<int64_t>(ids.size()) || values.size(1) != width)
    throw UserError("the trainable token rows of " + name + " have shape " + shape_text(values.sizes().vec()) + " for " +
                    std::to_string(ids.size()) + " ids of rows of " + std::to_string(width) + " values (lora.trainable_tokens "
                    "in the checkpoint's metadata.json). The checkpoint is damaged or hand-edited; use another one");
}

torch::Tensor replace_token_rows(const torch::Tensor& weight, const std::vector<int64_t>& ids, const torch::Tensor& values) {
  check_token_rows("the token embedding", weight.size(0), weight.dim() == 2 ? weight.size(1) : -1, ids, values);
  return weight.index_copy(0, ids_tensor(ids, weight.device()), values.to(weight.dtype()));
}

void attach_token_rows(torch::nn::Module& root, const TrainableTokens& tokens) {
  bool attached = false;
  for (const auto& item : root.named_modules()) {
    auto* layer = dynamic_cast<TokenRowsAdaptable*>(item.value().get());
    if (!layer || (item.key().empty() ? "weight" : item.key() + ".weight") != tokens.name) continue;
    const auto own = item.value()->named_parameters(false);
    if (const auto* weight = own.find("weight"))
      check_token_rows(tokens.name, weight->size(0), weight->size(1), tokens.ids, tokens.values);
    layer->set_token_rows(ids_tensor(tokens.ids, tokens.values.device()), tokens.values);
    attached = true;
  }
  TORCH_CHECK(attached, "attach_token_rows: no token embedding owns ", tokens.name);
}

void detach_token_rows(torch::nn::Module& root) {
  for (const auto& item : root.named_modules())
    if (auto* layer = dynamic_cast<TokenRowsAdaptable*>(item.value().get())) layer->set_token_rows({}, {});
}

static void enable_adapters(torch::nn::Module& root, bool on) {
  for_each_adaptable(root, [on](const std::string&, LoraAdaptable& layer) { layer.enable_lora(on); });
  for (const auto& item : root.named_modules())
    if (auto* layer = dynamic_cast<TokenRowsAdaptable*>(item.value().get())) layer->enable_token_rows(on);
}

AdaptersOff::AdaptersOff(torch::nn::Module& root) : root_(root) { enable_adapters(root_, false); }

AdaptersOff::~AdaptersOff() { enable_adapters(root_, true); }

torch::Tensor lora_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b,
                          const torch::Tensor& A, const torch::Tensor& B, double scale, const torch::Tensor& magnitude) {
  if (A.defined() && magnitude.defined()) {
    // DoRA: (m / ||W + s (A B)^T||) (x W^T + s (x A) B) + b; the bias stays outside the rescale, as in
    // PEFT. The norm is a constant to autograd; m gets its gradient through the factor.
    auto y = frozen_linear(x, W);
    auto xa = torch::matmul(x, weight_for(A, x));
    const int64_t out = y.size(-1);
    auto sum = torch::addmm(y.reshape({-1, out}), xa.reshape({-1, xa.size(-1)}), weight_for(B, x) * scale);
    auto factor = magnitude / dora_weight_norm(W, A, B, scale);
    auto z = (sum * factor.to(sum.scalar_type())).view(y.sizes());
    return b.defined() ? z + b.to(z.scalar_type()) : z;
  }
  return add_lora(x, frozen_linear(x, W, b), A, B, scale);
}

torch::Tensor add_lora(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& A, const torch::Tensor& B, double scale) {
  if (!A.defined()) return y;
  // (x A) B costs 2 r (in + out) per row instead of forming the (out, in) merged weight. The scale
  // goes on B (r x out) and the sum into the second product (addmm accumulates into y), so the
  // adapter adds no elementwise pass over the (rows x out) output.
  auto xa = torch::matmul(x, weight_for(A, x));
  const int64_t out = y.size(-1);
  auto sum = torch::addmm(y.reshape({-1, out}), xa.reshape({-1, xa.size(-1)}), weight_for(B, x) * scale);
  return sum.view(y.sizes());
}

std::vector<torch::Tensor> add_lora_shared_input(const torch::Tensor& x, std::vector<torch::Tensor> ys,
                                                 const std::vector<torch::Tensor>& A, const std::vector<torch::Tensor>& B,
                                                 const std::vector<double>& scales) {
  TORCH_CHECK(ys.size() == A.size() && A.size() == B.size() && B.size() == scales.size(), "add_lora_shared_input: ",
              ys.size(), " outputs, ", A.size(), " A, ", B.size(), " B, ", scales.size(), " scales");
  std::vector<torch::Tensor> cat;
  for (const auto& a : A)
    if (a.defined()) cat.push_back(a);
  if (cat.size() < 2) {  // nothing to share
    for (size_t i = 0; i < ys.size(); ++i) ys[i] = add_lora(x, ys[i], A[i], B[i], scales[i]);
    return ys;
  }
  // (..., sum of ranks); each adapter's columns are a view of it, read by its second product in place.
  auto xa = torch::matmul(x, weight_for(torch::cat(cat, 1), x));
  xa = xa.reshape({-1, xa.size(-1)});
  int64_t col = 0;
  for (size_t i = 0; i < ys.size(); ++i) {
    if (!A[i].defined()) continue;
    const int64_t r = A[i].size(1), out = ys[i].size(-1);
    ys[i] = torch::addmm(ys[i].reshape({-1, out}), xa.narrow(1, col, r), weight_for(B[i], x) * scales[i]).view(ys[i].sizes());
    col += r;
  }
  return ys;
}

}  // namespace lt
