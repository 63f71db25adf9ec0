// Low-rank adapters (LoRA), generic over any LibTorch module tree.
//
// A targeted weight W keeps its name and stays where it is (frozen, bf16); its adapter is a pair
//   A: (in, r), drawn by LoraInit           B: (r, out), zeros
// and the effective weight is W_eff = W + (alpha / r) * (A B)^T in LibTorch's (out, in) layout.
// In training the adapted layer computes x W^T + b + (alpha / r) (x A) B and never forms W_eff.
//
// DoRA (Liu et al., 2024; PEFT's use_dora) adds a magnitude m: (out) f32 per adapted weight, and the
// effective weight becomes m * W_eff / ||W_eff||, the norm taken per output feature (each row of
// W_eff) and treated as a constant in the backward (the paper's sec. 4.3, as PEFT does). m starts at
// the row norms of the frozen base, so a fresh DoRA adapter changes nothing. The layer computes
// (m / ||W_eff||) (x W^T + s (x A) B) + b: the norm needs W_eff's rows, the matmul does not.
//
// The adapters are parameters of the layer they adapt, as torchtune's LoRALinear holds them: a layer
// with an adapter registers `lora_A`, `lora_B` (and DoRA's `lora_magnitude`) beside its `weight`, so
// `named_parameters()` lists "h.0.attn.c_attn.lora_A" and every consumer (the optimizer, LoRA+'s rates,
// parameter groups, checkpoints as params/<name>) finds them by name. The frozen base weight is kept and
// produced for the matmul by its FrozenWeight (frozen_weight.hpp): bf16 today.
//
// This file depends on LibTorch alone (and util's UserError): `param_filter` and `inject_lora_params`
// work on any `named_parameters()` list; a layer takes an adapter by implementing `LoraAdaptable`. A
// setting that does not fit the model is a LoraSettingError naming the setting; the trainer names its
// config key. Adapters that contradict their own rank (a bad file) are a UserError.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/peft/block_shard.hpp"
#include "lora_trainer/peft/frozen_weight.hpp"

namespace lt {

// A LoRA setting that does not fit the model. `setting()` is which ("target_modules", "rank",
// "modules_to_save", "init"); the message says what is wrong with it and what would fit.
class LoraSettingError : public std::invalid_argument {
 public:
  LoraSettingError(std::string setting, const std::string& what) : std::invalid_argument(what), setting_(std::move(setting)) {}
  const std::string& setting() const { return setting_; }

 private:
  std::string setting_;
};

// A layer whose 2-D `weight` can carry an adapter.
class LoraAdaptable {
 public:
  virtual ~LoraAdaptable() = default;
  // A: (in, r), B: (r, out), scale = alpha / r; magnitude: (out) for DoRA, undefined for plain LoRA.
  // The tensors become the layer's parameters lora_A, lora_B, lora_magnitude (the same tensors, not
  // copies). Undefined A and B remove the adapter.
  virtual void set_lora(torch::Tensor A, torch::Tensor B, double scale, torch::Tensor magnitude) = 0;
  // Freezes `weight` in `format`: from now on the layer's matmul takes it from its FrozenWeight. A
  // weight already frozen in that format stays as it is.
  virtual void freeze_weight(FrozenFormat format) = 0;
  // The storage of the frozen weight; null while it trains.
  virtual std::shared_ptr<FrozenWeight> frozen() const = 0;
  // Replaces the storage of the frozen weight by another of the same W (shard_frozen_weights).
  virtual void set_frozen(std::shared_ptr<FrozenWeight> storage) = 0;
  // Off: the layer computes with its base weight alone (no DoRA rescale either), its adapter kept
  // attached (AdaptersOff).
  virtual void enable_lora(bool on) = 0;
};

// A token embedding whose chosen rows can be replaced by trainable values (PEFT's trainable tokens).
class TokenRowsAdaptable {
 public:
  virtual ~TokenRowsAdaptable() = default;
  // ids: (n) int64 token ids, values: (n, d) f32, the rows that replace the weight's rows `ids` in the
  // lookup and in a head tied to it; `values` becomes the layer's parameter trainable_tokens_delta.
  // Undefined tensors remove them.
  virtual void set_token_rows(torch::Tensor ids, torch::Tensor values) = 0;
  // Off: the lookup (and a tied head) use the frozen weight's rows, as if none were set (AdaptersOff).
  virtual void enable_token_rows(bool on) = 0;
};

// PEFT's `trainable_token_indices`: chosen rows of the token embedding train beside the adapters. As in
// PEFT (trainable_tokens_delta), `values` holds the rows' new values, not a difference: initialised to
// the base's rows, they replace those rows (W.index_copy(0, ids, values)) in the lookup and in an
// output head tied to the embedding; every other row stays frozen.
struct TrainableTokens {
  std::string name;           // the embedding's weight ("wte.weight"); "" = none
  std::vector<int64_t> ids;   // token ids, in the configured order
  torch::Tensor values;       // (ids.size(), d) f32
  bool defined() const { return !name.empty(); }
  // "wte.weight" -> "wte.trainable_tokens_delta": its name in checkpoints and the optimizer.
  static std::string values_name(const std::string& base_name);
};

// The weights of `root` owned by a TokenRowsAdaptable layer (the token embeddings), in module order.
std::vector<std::string> token_embeddings(torch::nn::Module& root);

// Which embedding weight a `trainable_token_indices` setting names: `module` "" is the model's token
// embedding (PEFT's list form); otherwise (PEFT's dict form {module: [ids]}) the embedding module by its
// name or a suffix after a '.' ("wte", "embed_tokens"). Each id must lie in [0, rows of the weight) and
// appear once. A module that is not a token embedding, no ids, or an id out of range or repeated is a
// LoraSettingError ("trainable_token_indices") naming it.
std::string resolve_trainable_tokens(torch::nn::Module& root, const NamedTensors& params, const std::string& module,
                                     const std::vector<int64_t>& ids);

// The rows `ids` of `weight`, as f32 trainable values.
TrainableTokens make_trainable_tokens(const std::string& name, const torch::Tensor& weight, const std::vector<int64_t>& ids);

// `weight` with the rows `ids` replaced by `values` (cast to weight's dtype): the merged embedding.
torch::Tensor replace_token_rows(const torch::Tensor& weight, const std::vector<int64_t>& ids, const torch::Tensor& values);

// Hands the rows to the layer that owns `tokens.name`; detach_token_rows removes them from every layer.
void attach_token_rows(torch::nn::Module& root, const TrainableTokens& tokens);
void detach_token_rows(torch::nn::Module& root);

// The adapters of one model, in the order of the base parameters they adapt.
struct LoraParams {
  std::vector<std::string> names;  // base parameter names ("h.0.attn.c_attn.weight")
  std::vector<torch::Tensor> A;    // (in, r) each
  std::vector<torch::Tensor> B;    // (r, out) each
  // DoRA's magnitudes, (out) f32 each, one per name; empty for plain LoRA.
  std::vector<torch::Tensor> magnitude;
  bool dora() const { return !magnitude.empty(); }
  // "h.0.attn.c_attn.weight" -> "h.0.attn.c_attn.lora_A" / ".lora_B" / ".lora_magnitude": the names
  // used in checkpoints and by the optimizer.
  static std::string a_name(const std::string& base_name);
  static std::string b_name(const std::string& base_name);
  static std::string magnitude_name(const std::string& base_name);
  // Per adapted weight A, B (and its magnitude with DoRA), in order: the trainer's stable order.
  NamedTensors named() const;
};

// How A is drawn (B starts at zero either way, so training starts from the base model). The names
// are PEFT's values of `init_lora_weights`, which draw the same distributions:
//   Gaussian        normal(0, 1/r): the reference framework's init, PEFT's "gaussian"
//   KaimingUniform  uniform(-1/sqrt(in), 1/sqrt(in)): PEFT's default (true), nn.Linear's own init
enum class LoraInit { Gaussian, KaimingUniform };
const std::vector<std::string>& lora_init_names();  // "gaussian", "kaiming_uniform": in LoraInit's order
LoraInit parse_lora_init(const std::string& s);      // LoraSettingError naming the names for another
const char* to_string(LoraInit init);

// Which parameters get adapters: 2-D weights whose name contains any of `target_modules`.
// A target that matches no 2-D parameter is a LoraSettingError listing the parameter names.
std::vector<bool> param_filter(const NamedTensors& params, const std::vector<std::string>& target_modules);

// PEFT's "all-linear" as a target_modules entry: every weight of `root` that can take an adapter
// except the output head (lm_head.weight), as PEFT leaves the output layer out. Returns `targets` with
// that entry replaced by those full names (other entries unchanged).
inline const char* kAllLinear = "all-linear";
std::vector<std::string> expand_target_modules(torch::nn::Module& root, const std::vector<std::string>& targets);

// Creates f32 A/B for every masked parameter, deterministically from `generator`; with `dora`, the
// magnitudes too: dora_weight_norm of each weight with B = 0, its row norms.
LoraParams inject_lora_params(const NamedTensors& params, const std::vector<bool>& mask, int64_t rank,
                              torch::Generator generator, LoraInit init = LoraInit::Gaussian, bool dora = false);

// Which base parameters train in full beside the adapters (PEFT's `modules_to_save`): an entry names a
// module or a parameter, by its whole name or a suffix after a '.' ("wte" and "transformer.wte" match
// "wte.weight"; "ln_f" matches "ln_f.weight" and "ln_f.bias"; "ln_1" every block's first norm). An
// entry that matches nothing, or a parameter that also has an adapter (`lora_mask`), is a LoraSettingError.
std::vector<bool> modules_to_save_filter(const NamedTensors& params, const std::vector<std::string>& modules,
                                         const std::vector<bool>& lora_mask);

// The adapters' scale: alpha / r, or with rsLoRA (Kalajdzievski, 2023) alpha / sqrt(r), which keeps
// the update's size from shrinking as r grows (PEFT's use_rslora).
double lora_scale(double alpha, int64_t rank, bool rslora = false);

// DoRA's ||W + scale (A B)^T|| per output feature: (out) f32, computed in f32 whatever W's dtype and
// autocast, without gradient (the paper's detached norm). W: (out, in), A: (in, r), B: (r, out).
torch::Tensor dora_weight_norm(const torch::Tensor& W, const torch::Tensor& A, const torch::Tensor& B, double scale);

// A UserError unless A is (in, rank) and B (rank, out) for W (out, in): adapters read from a file whose
// metadata gives another rank (or whose tensors belong to another weight) would merge with the wrong
// scale. The message names `weight` (when given), the shapes and both ranks.
void check_adapter_shapes(const std::string& weight, const torch::Tensor& W, const torch::Tensor& A,
                          const torch::Tensor& B, int64_t rank);

// W + lora_scale(alpha, rank, rslora) (A B)^T, computed in f32 and cast back to W's dtype; with a DoRA
// `magnitude` (out), that times magnitude / its row norms. base: (out, in), A: (in, r), B: (r, out),
// checked (check_adapter_shapes).
torch::Tensor merge_lora_params(const torch::Tensor& base, const torch::Tensor& A, const torch::Tensor& B,
                                double alpha, int64_t rank, bool rslora = false, const torch::Tensor& magnitude = {});
// Every parameter of `base`, with the adapted ones merged (DoRA's rule where `lora` has magnitudes).
NamedTensors merge_lora_params(const NamedTensors& base, const LoraParams& lora, double alpha, int64_t rank,
                               bool rslora = false);

// Whether a parameter name is an adapter's: "<layer>.lora_A", ".lora_B" or ".lora_magnitude"
// (is_lora_param), or trainable token rows, "<embedding>.trainable_tokens_delta" (is_adapter_param
// covers both). The base parameters are every other one.
bool is_lora_param(const std::string& name);
bool is_adapter_param(const std::string& name);

// LoRA+ (Hayou et al., 2024) by name: B and DoRA's magnitude learn at `lr_ratio` times A's rate, as
// PEFT's LoRA+ optimizer groups them; A (and anything else) at 1.
double lora_plus_lr_scale(const std::string& name, double lr_ratio);

// The adapters attached to the layers of `root`, found by name in its module tree, in module order:
// the same tensors the layers hold (names: the adapted weights).
LoraParams lora_params_of(torch::nn::Module& root);

// Freezes the base of `root` for the LoRA phase: every parameter except the adapters and those named in
// `keep` (modules_to_save) stops taking gradients; each adaptable layer's weight is stored through its
// FrozenWeight in the format `format_of` gives for the weight's name (bf16, or nf4 for a QLoRA base's
// block layers), every other parameter (norms, embeddings) cast to bf16 in place.
using FrozenFormatOf = std::function<FrozenFormat(const std::string& weight)>;
void freeze_base(torch::nn::Module& root, const std::vector<std::string>& keep, const FrozenFormatOf& format_of);

// The frozen weights of `root`'s adaptable layers that are stored otherwise than in their parameter
// (nf4, sharded), by weight name.
std::map<std::string, std::shared_ptr<FrozenWeight>> frozen_storages(torch::nn::Module& root);

// distributed/shard_params=lora: the frozen storages of the weights in `blocks` (weight names, one list
// per transformer block, in the model's order) become sharded storages, one BlockShard a block
// (block_shard.hpp); each weight must be frozen already. What each rank keeps of
// W's values is stored from the storages' values (a template's zeros where they hold none). Returns the
// blocks' shards, in order, for the model's forward to gather (set_block_shards links them for prefetching).
std::vector<std::shared_ptr<BlockShard>> shard_frozen_weights(torch::nn::Module& root,
                                                              const std::vector<std::vector<std::string>>& blocks,
                                                              Distributed& dist, const torch::Device& device);

// Number of trainable adapter values.
int64_t count_lora_params(const LoraParams& lora);

// Names of the weights in `root` that can take an adapter (owned by a LoraAdaptable layer).
std::vector<std::string> adaptable_weights(torch::nn::Module& root);
// The same layers by their weight's name.
std::map<std::string, LoraAdaptable*> adaptable_layers(torch::nn::Module& root);

// LoraSettingError unless every name is an adaptable weight, and rank fits each of them.
void check_lora_targets(torch::nn::Module& root, const NamedTensors& params, const std::vector<bool>& mask,
                        int64_t rank);

// Hands each adapter (and its DoRA magnitude) to the layer that owns its base weight (found by name in
// `root`'s module tree).
void attach_lora(torch::nn::Module& root, const LoraParams& lora, double alpha, int64_t rank, bool rslora = false);
void detach_lora(torch::nn::Module& root);

// While it lives, every adapter and trainable token row under `root` is switched off and the model
// computes as its base (PEFT's `disable_adapter()`): DPO's reference model without a second copy of the
// weights. The adapters and rows stay attached and come back on when it ends.
class AdaptersOff {
 public:
  explicit AdaptersOff(torch::nn::Module& root);
  ~AdaptersOff();
  AdaptersOff(const AdaptersOff&) = delete;
  AdaptersOff& operator=(const AdaptersOff&) = delete;

 private:
  torch::nn::Module& root_;
};

// x: (..., in), W: (out, in), b: (out) or undefined, A: (in, r), B: (r, out) or undefined,
// magnitude: (out) for DoRA or undefined.
// y + s (x A) B: the adapter's part added to the base product y = x W^T (+ b) (plain LoRA).
torch::Tensor add_lora(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& A, const torch::Tensor& B, double scale);
// add_lora for several layers that read the same x (Llama's q, k and v projections; gate and up):
// ys[i] + scales[i] (x A_i) B_i for each i, with x [A_1 | A_2 | ...] as one product instead of one
// skinny (rank-wide) product per layer, and so one product each for the A's gradient and x's in the
// backward. A layer without an adapter has undefined A[i] and B[i] and keeps ys[i].
std::vector<torch::Tensor> add_lora_shared_input(const torch::Tensor& x, std::vector<torch::Tensor> ys,
                                                 const std::vector<torch::Tensor>& A, const std::vector<torch::Tensor>& B,
                                                 const std::vector<double>& scales);
torch::Tensor lora_linear(const torch::Tensor& x, const torch::Tensor& W, const torch::Tensor& b,
                          const torch::Tensor& A, const torch::Tensor& B, double scale,
                          const torch::Tensor& magnitude = {});

}  // namespace lt
