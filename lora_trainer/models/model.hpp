// The model seam: what a trainer needs from a causal language model, the architecture options
// (`architecture/*`, typed once from the config) and the factory keyed by `architecture/family`.
//
// Families (one file each):
//   gpt2   gpt2.hpp   learned positions, LayerNorm, GELU MLP, head tied to the token embedding;
//                     parameter names are GPT-2's (wte.weight, h.0.attn.c_attn.weight, ...)
//   llama  llama.hpp  Llama / Qwen2 / Mistral: rotary positions, RMSNorm, gated MLP (SwiGLU),
//                     grouped-query attention, optional q/k/v biases, tied or untied head; parameter
//                     names are Hugging Face's (model.layers.0.self_attn.q_proj.weight, ...)
// A new family is a new file and one line in make_model(); the trainers do not change.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "lora_trainer/models/kv_cache.hpp"
#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/core/named_tensors.hpp"
#include "lora_trainer/core/runtime.hpp"

namespace lt {

class Config;
class ConfigSchema;

enum class ModelFamily { Gpt2, Llama };
const std::vector<std::string>& model_family_names();  // "gpt2", "llama": in ModelFamily's order
ModelFamily parse_model_family(const std::string& s);  // UserError naming architecture/family and the names for another
const char* to_string(ModelFamily f);

// architecture/*, runtime/attention and training/activation_checkpointing, read once.
struct ModelOptions {
  ModelFamily family = ModelFamily::Gpt2;
  int64_t vocab_size = 50257;
  int64_t block_size = 256;
  int64_t n_layer = 6;
  int64_t n_head = 6;
  int64_t n_kv_head = -1;  // llama: grouped-query key/value heads (divide n_head); -1 = n_head (kv_heads())
  int64_t d_model = 384;
  int64_t d_ff = -1;       // the MLP's hidden width; -1 = 4 d_model (ff())
  double dropout = 0.0;
  // The MLP's activation: GELU exact (erf) or its tanh approximation (GPT-2's own weights, HF's
  // gelu_new), or SiLU (llama's gate: SwiGLU).
  enum class Activation { Gelu, GeluTanh, Silu } activation = Activation::Gelu;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // llama
  RopeScaling rope_scaling;     // llama: none, linear or Llama 3.1's (layers.hpp)
  bool tie_embeddings = true;   // the output head is the token embedding (gpt2: always)
  bool qkv_bias = false;        // llama: biases on q_proj, k_proj, v_proj (Qwen2)
  // runtime/attention. auto: fused on CUDA (where LibTorch has it), masked softmax on the CPU, where
  // LibTorch 2.6's fused kernel measured 1.6-1.8x slower for the whole step (docs/performance.md).
  using Attention = RuntimeOptions::Attention;
  Attention attention = Attention::Auto;
  // runtime/loss: which kernels compute the loss of bf16 logits (cross_entropy.hpp). auto: this
  // project's fused kernel on the CPU, and on CUDA in a build with its CUDA kernels (measured faster on
  // both: docs/performance.md); LibTorch's log_softmax + nll_loss on CUDA in a build without them.
  using Loss = RuntimeOptions::Loss;
  Loss loss = Loss::Auto;
  // training/activation_checkpointing: the blocks recompute their activations in the backward
  // (activation_checkpointing.hpp). A way of computing the forward, like `attention`: it changes the
  // memory a training step holds and its time, not its result.
  bool activation_checkpointing = false;

  int64_t head_dim() const { return d_model / n_head; }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t ff() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  bool fused_attention_on(const torch::Device& device) const;
  bool fused_loss_on(const torch::Device& device) const;
  // Whether a head that takes no gradient computes its loss over blocks of the vocabulary, the logits never
  // whole (kernels/head_loss.hpp); heads that train take the fused (or LibTorch's) loss.
  bool chunked_loss_on(const torch::Device& device) const;
  // A UserError naming the architecture/ key of the first inconsistency.
  void validate() const;
  static ModelOptions from_config(const Config& cfg);
};

// architecture/activation's name of an activation: "gelu", "gelu_tanh" or "silu".
const char* activation_name(ModelOptions::Activation a);
// architecture/rope_scaling's name of a rotary scaling: "none", "linear" or "llama3".
const char* rope_scaling_name(RopeScaling::Kind kind);

// A config of only the keys ModelOptions::from_config reads (architecture/*, runtime/attention and
// runtime/loss, training/activation_checkpointing) at their defaults: a model's options without any
// job's schema (an import, a checkpoint read for export).
Config model_config();

// The settings of `settings` (architecture/KEY=VALUE, as a model directory's config.json gives them:
// hf_architecture) whose value differs from `cfg`'s, each with cfg's value; numbers compare as numbers.
// architecture/block_size is skipped: the rows' length is a job's choice.
std::vector<std::pair<std::string, nlohmann::json>> differing_architecture(const Config& cfg,
                                                                           const std::vector<std::string>& settings);
// A UserError naming `source` and the key when `saved` (a checkpoint's saved "architecture" block; a key
// it lacks had its default) gives a model that computes differently from cfg's with the same shapes:
// family, activation, heads, norm epsilon, rotary base and scaling. The shapes say nothing about these:
// weights trained with one GELU would load silently into a model computing another.
void check_same_computation(const Config& cfg, const nlohmann::json& saved, const std::string& source);

// The architecture/* options and training/activation_checkpointing, each bound to the ModelOptions
// field it sets (model.cpp's OptionGroup); runtime/attention and runtime/loss are the runtime's keys,
// which from_config reads too.
void add_model_options(ConfigSchema& s);

// What the trainers call. Implementations are torch modules whose named_parameters() are the
// checkpoint names; layers that can take adapters are LinearImpl (layers.hpp).
class CausalLMImpl : public torch::nn::Module {
 public:
  // idx: (B, T) int64 token ids, T <= block_size -> logits (B, T, V). segments: undefined (each row one
  // sequence) or, for rows of packed examples, (B, T) int64 example numbers (SequenceLayout, layers.hpp).
  virtual torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& segments = {}) = 0;
  // Sum of the cross-entropy over positions whose target is >= 0 (count them with count_targets).
  // idx, targets: (B, T) int64; targets < 0 are ignored (padding); segments as for forward(). Reads
  // nothing back from the device, so a CUDA step is not held up waiting for it.
  virtual torch::Tensor loss_sum(const torch::Tensor& idx, const torch::Tensor& targets, const torch::Tensor& segments = {}) = 0;
  // Generation's forward (no gradients; generate.hpp): idx (B, t) int64, the tokens at positions
  // cache.length() .. cache.length() + t - 1 (within block_size), their keys and values added to `cache`
  // -> the logits (B, V) of the last of them. The same numbers as forward() over the whole context, up
  // to rounding.
  virtual torch::Tensor forward_cached(const torch::Tensor& idx, KvCache& cache) = 0;
  // The family's initialisation of every parameter, drawn from `gen`.
  virtual void init_weights(torch::Generator gen) = 0;
  // The parameters that are looked up rather than multiplied (excluded from FLOP counts).
  virtual bool is_lookup(const std::string& param_name) const = 0;
  // The transformer block (0 .. n_layer - 1) a parameter belongs to, or -1 for the embeddings, the
  // final norm and the output head.
  virtual int64_t block_of(const std::string& param_name) const = 0;
  // Whether it belongs to one of the blocks: what a QLoRA base quantizes, a sharded base shards.
  bool in_blocks(const std::string& param_name) const { return block_of(param_name) >= 0; }
  const ModelOptions& options() const { return opts_; }
  // distributed/shard_params: each block's sharded frozen weights (block_shard.hpp), gathered around its
  // forwards; one a block, in order, or none.
  void set_block_shards(std::vector<std::shared_ptr<BlockShard>> shards);
  const std::vector<std::shared_ptr<BlockShard>>& block_shards() const { return block_shards_; }

 protected:
  explicit CausalLMImpl(ModelOptions o) : opts_(std::move(o)) {}
  // Block i's shard, or null.
  BlockShard* block_shard(size_t i) const { return i < block_shards_.size() ? block_shards_[i].get() : nullptr; }
  // The block number of a parameter named <prefix><number>.<rest>, else -1.
  static int64_t block_number(const std::string& param_name, const std::string& prefix);
  ModelOptions opts_;

 private:
  std::vector<std::shared_ptr<BlockShard>> block_shards_;
};
using CausalLM = std::shared_ptr<CausalLMImpl>;

// The model of `o.family`, uninitialised (call init_weights or load weights).
CausalLM make_model(const ModelOptions& o);

// The number of targets >= 0 (positions that count in the loss). Count on the host copy of a batch.
int64_t count_targets(const torch::Tensor& targets);

// named_parameters() as an ordered vector: the single source of parameter identity. In the LoRA phase
// it includes the adapters (lora.hpp: "<layer>.lora_A", ...), which are parameters of their layers.
NamedTensors named_params(torch::nn::Module& m);
// The model's own parameters: named_params without the adapters' (is_adapter_param).
NamedTensors base_params(torch::nn::Module& m);

}  // namespace lt
