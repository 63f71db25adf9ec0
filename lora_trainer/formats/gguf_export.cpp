#include "lora_trainer/formats/gguf_export.hpp"

#include "lora_trainer/data/chat_template.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/data/tokenizer_choice.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/export.hpp"
#include "lora_trainer/formats/gguf.hpp"
#include "lora_trainer/formats/lora_metadata.hpp"
#include "lora_trainer/models/layers.hpp"
#include "lora_trainer/models/model.hpp"
#include "lora_trainer/peft/lora.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace lt {

namespace {

// llama.cpp's pre-tokenizer names for the patterns it implements (llama-vocab.cpp), by the
// transformers pattern they stand for.
const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
const char* kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";

// llama.cpp's token types (llama.h's llama_token_type / gguf's TokenType).
enum TokenType : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };
// general.file_type (llama_ftype): all f32, mostly f16, mostly bf16.
uint32_t file_type(torch::ScalarType t) { return t == torch::kFloat16 ? 1 : t == torch::kBFloat16 ? 32 : 0; }

std::string architecture_of(const ModelOptions& o) {
  if (o.family == ModelFamily::Gpt2) return "gpt2";
  return o.qkv_bias ? "qwen2" : "llama";
}

// Our parameter name -> llama.cpp's tensor name; "" for a name llama.cpp has no tensor for.
std::string gguf_name(ModelFamily family, const std::string& n) {
  static const std::regex block(R"((?:model\.layers|h)\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(n, m, block)) {
    static const std::map<std::string, std::string> gpt2 = {
        {"ln_1.weight", "attn_norm.weight"},       {"ln_1.bias", "attn_norm.bias"},
        {"attn.c_attn.weight", "attn_qkv.weight"}, {"attn.c_attn.bias", "attn_qkv.bias"},
        {"attn.c_proj.weight", "attn_output.weight"}, {"attn.c_proj.bias", "attn_output.bias"},
        {"ln_2.weight", "ffn_norm.weight"},        {"ln_2.bias", "ffn_norm.bias"},
        {"mlp.c_fc.weight", "ffn_up.weight"},      {"mlp.c_fc.bias", "ffn_up.bias"},
        {"mlp.c_proj.weight", "ffn_down.weight"},  {"mlp.c_proj.bias", "ffn_down.bias"}};
    static const std::map<std::string, std::string> llama = {
        {"input_layernorm.weight", "attn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"}, {"self_attn.q_proj.bias", "attn_q.bias"},
        {"self_attn.k_proj.weight", "attn_k.weight"}, {"self_attn.k_proj.bias", "attn_k.bias"},
        {"self_attn.v_proj.weight", "attn_v.weight"}, {"self_attn.v_proj.bias", "attn_v.bias"},
        {"self_attn.o_proj.weight", "attn_output.weight"},
        {"post_attention_layernorm.weight", "ffn_norm.weight"},
        {"mlp.gate_proj.weight", "ffn_gate.weight"},  {"mlp.up_proj.weight", "ffn_up.weight"},
        {"mlp.down_proj.weight", "ffn_down.weight"}};
    const auto& table = family == ModelFamily::Gpt2 ? gpt2 : llama;
    auto it = table.find(m[2].str());
    return it == table.end() ? "" : "blk." + m[1].str() + "." + it->second;
  }
  static const std::map<std::string, std::string> gpt2 = {{"wte.weight", "token_embd.weight"},
                                                          {"wpe.weight", "position_embd.weight"},
                                                          {"ln_f.weight", "output_norm.weight"},
                                                          {"ln_f.bias", "output_norm.bias"},
                                                          {"lm_head.weight", "output.weight"}};
  static const std::map<std::string, std::string> llama = {{"model.embed_tokens.weight", "token_embd.weight"},
                                                           {"model.norm.weight", "output_norm.weight"},
                                                           {"lm_head.weight", "output.weight"}};
  const auto& table = family == ModelFamily::Gpt2 ? gpt2 : llama;
  auto it = table.find(n);
  return it == table.end() ? "" : it->second;
}

// The rows of a q or k projection (or of its adapter's B) reordered per head from transformers'
// halves to llama.cpp's interleaved pairs (convert_hf_to_gguf.py's LlamaModel.permute): in each head,
// row i of the first half goes to 2i and row i of the second half to 2i + 1.
torch::Tensor permute_rows(const torch::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0);
  return w.reshape({heads, 2, rows / heads / 2, -1}).transpose(1, 2).reshape(w.sizes()).contiguous();
}

// Which heads a weight's rows are permuted over in the "llama" architecture; 0 = not permuted.
int64_t permuted_heads(const std::string& arch, const std::string& gguf, const ModelOptions& o) {
  if (arch != "llama") return 0;
  if (ends_with(gguf, ".attn_q.weight")) return o.n_head;
  if (ends_with(gguf, ".attn_k.weight")) return o.kv_heads();
  return 0;
}

void set_hyperparameters(GgufWriter& g, const std::string& arch, const ModelOptions& o, const CheckpointMeta& ck) {
  const std::string a = arch + ".";
  // The context the model was trained for: an imported model's own max_position_embeddings (a rotary
  // model keeps a shorter block_size for training), else the block size.
  int64_t context = o.block_size;
  const json hf = ck.base_hf_config();
  if (o.family != ModelFamily::Gpt2 && hf.is_object() && hf.value("max_position_embeddings", json()).is_number_integer())
    context = std::max<int64_t>(context, hf["max_position_embeddings"].get<int64_t>());
  g.set_u32(a + "context_length", static_cast<uint32_t>(context));
  g.set_u32(a + "embedding_length", static_cast<uint32_t>(o.d_model));
  g.set_u32(a + "block_count", static_cast<uint32_t>(o.n_layer));
  g.set_u32(a + "feed_forward_length", static_cast<uint32_t>(o.ff()));
  g.set_u32(a + "attention.head_count", static_cast<uint32_t>(o.n_head));
  g.set_u32(a + "vocab_size", static_cast<uint32_t>(o.vocab_size));
  if (o.family == ModelFamily::Gpt2) {
    g.set_f32(a + "attention.layer_norm_epsilon", static_cast<float>(o.norm_eps));
    return;
  }
  g.set_u32(a + "attention.head_count_kv", static_cast<uint32_t>(o.kv_heads()));
  g.set_f32(a + "attention.layer_norm_rms_epsilon", static_cast<float>(o.norm_eps));
  g.set_f32(a + "rope.freq_base", static_cast<float>(o.rope_theta));
  g.set_u32(a + "rope.dimension_count", static_cast<uint32_t>(o.head_dim()));
  if (o.rope_scaling.kind == RopeScaling::Kind::Linear) {
    g.set_string(a + "rope.scaling.type", "linear");
    g.set_f32(a + "rope.scaling.factor", static_cast<float>(o.rope_scaling.factor));
  }
}

// Llama 3.1's frequency scaling as llama.cpp takes it: rope_freqs.weight, by which each of the
// head_dim / 2 frequencies is divided (the converter's factors: the unscaled over the scaled).
void add_rope_factors(GgufWriter& g, const ModelOptions& o) {
  if (o.family == ModelFamily::Gpt2 || o.rope_scaling.kind != RopeScaling::Kind::Llama3) return;
  const auto cpu = torch::Device(torch::kCPU);
  g.add_tensor("rope_freqs.weight", (rope_inv_freq(o.head_dim(), o.rope_theta, RopeScaling{}, cpu) /
                                     rope_inv_freq(o.head_dim(), o.rope_theta, o.rope_scaling, cpu))
                                        .to(torch::kFloat32));
}

std::string tokenizer_for(const std::string& requested, const CheckpointMeta& ck, const ModelOptions& o) {
  if (requested != "auto") return requested;
  return auto_tokenizer(checkpoint_tokenizer_clues(ck.dir, ck.tokenizer, ck.step, ck.config, ck.base_hf_dir(), o.vocab_size),
                        "export --format gguf");
}

std::string pre_tokenizer_name(const BpeVocabulary& v, const std::string& tokenizer) {
  if (v.gpt2_pattern || v.patterns.empty()) return "gpt-2";  // byte (no merges) splits nothing that matters
  if (v.patterns.size() == 1 && v.patterns[0] == kLlama3Pattern) return "llama-bpe";
  if (v.patterns.size() == 1 && v.patterns[0] == kQwen2Pattern) return "qwen2";
  throw UserError("export --format gguf: the pre-tokenizer of " + tokenizer + " (" + join(v.patterns, " then ") +
                  ") is none that llama.cpp knows by name (GPT-2's, Llama 3's, Qwen2's); llama.cpp would split text "
                  "differently. Nothing was written");
}

// The chat format a model trained on conversations was trained with (its checkpoint's "chat"), checked
// against the model's vocabulary; nullopt for one without.
std::optional<ChatFormat> chat_format(const CheckpointMeta& ck, const ModelOptions& o) {
  if (ck.chat.is_null()) return std::nullopt;
  ChatFormat chat = ChatFormat::from_json(ck.chat, ck.dir + "/metadata.json: chat");
  for (uint32_t id : chat.stop_ids)
    if (id >= o.vocab_size)
      throw UserError(ck.dir + "/metadata.json: chat.stop_ids holds " + std::to_string(id) + ", outside the model's vocabulary (" +
                      std::to_string(o.vocab_size) + "); the checkpoint is damaged or hand-edited. Nothing was written");
  return chat;
}

// The tokenizer `name`, and a chat model's template, as convert_hf_to_gguf.py writes an instruct
// model's: tokenizer.chat_template, the end of turn (tokenizer_config.json's eos_token) as the eos id,
// which llama.cpp stops at, and the template's bos_token as the bos id.
void set_tokenizer(GgufWriter& g, const std::string& name, const ModelOptions& o, const std::optional<ChatFormat>& chat) {
  const BpeVocabulary v = make_tokenizer(name)->vocabulary();
  const auto n = static_cast<int64_t>(v.tokens.size());
  if (n > o.vocab_size)
    throw UserError("export --format gguf: the tokenizer " + name + " has " + std::to_string(n) +
                    " tokens, more than the model's vocabulary (" + std::to_string(o.vocab_size) +
                    "); give the model's own with --tokenizer. Nothing was written");
  std::vector<std::string> tokens(v.tokens);
  std::vector<int32_t> types;
  for (int64_t id = 0; id < o.vocab_size; ++id) {
    const auto kind = id < n ? v.kinds[id] : BpeVocabulary::Kind::Gap;
    if (kind == BpeVocabulary::Kind::Gap) {
      if (id < n) tokens[id] = "[PAD" + std::to_string(id) + "]";
      else tokens.push_back("[PAD" + std::to_string(id) + "]");
    }
    types.push_back(kind == BpeVocabulary::Kind::Ordinary ? kNormal
                    : kind == BpeVocabulary::Kind::Special ? kControl
                    : kind == BpeVocabulary::Kind::Added   ? kUserDefined
                                                           : kUnused);
  }
  g.set_string("tokenizer.ggml.model", "gpt2");
  g.set_string("tokenizer.ggml.pre", pre_tokenizer_name(v, name));
  g.set_strings("tokenizer.ggml.tokens", tokens);
  g.set_i32s("tokenizer.ggml.token_type", types);
  g.set_strings("tokenizer.ggml.merges", v.merges);
  // The bos token: the chat format's (tokenizer_config.json's bos_token, which a template writes as
  // {{ bos_token }} and llama.cpp's chat fills in with this id: Llama 3's <|begin_of_text|>, whether or
  // not its tokenizer adds it to plain text), else the one the tokenizer adds, else the end of text.
  int64_t bos = v.bos;
  if (chat && !chat->bos_token.empty())
    for (int64_t id = 0; id < n; ++id)
      if (v.kinds[id] != BpeVocabulary::Kind::Ordinary && v.tokens[id] == chat->bos_token) bos = id;
  g.set_u32("tokenizer.ggml.eos_token_id", chat ? chat->stop_ids.front() : v.eos);
  g.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(bos >= 0 ? bos : v.eos));
  g.set_bool("tokenizer.ggml.add_bos_token", v.bos >= 0);
  g.set_bool("tokenizer.ggml.add_eos_token", false);
  if (chat) g.set_string("tokenizer.chat_template", chat->template_source);
}

// llama.cpp's llama and qwen2 gate the MLP with SiLU, its gpt2 uses the tanh form of GELU: a model (or
// an adapter for one) that computes another activation is refused, the exact GELU noted.
void check_activation(const ModelOptions& options, const std::string& arch, const std::string& checkpoint,
                      const std::string& format) {
  if (options.family != ModelFamily::Gpt2 && options.activation != ModelOptions::Activation::Silu)
    throw UserError("export --format " + format + ": " + checkpoint + " is a llama-family model with architecture/activation " +
                    activation_name(options.activation) + "; llama.cpp's " + arch +
                    " computes SiLU, so its outputs would not be this model's. Nothing was written");
  if (options.family == ModelFamily::Gpt2 && options.activation == ModelOptions::Activation::Gelu)
    std::printf("note: this model's MLP uses the exact GELU (architecture/activation=gelu); llama.cpp's gpt2 computes "
                "its tanh approximation, so its logits will differ slightly from ours\n");
}

std::string model_name(const std::string& checkpoint, const CheckpointMeta& ck) {
  const std::string name = ck.job ? ck.job->name : std::string();
  return name.empty() ? fs::path(fs::absolute(checkpoint)).lexically_normal().filename().string() : name;
}

}  // namespace

void export_gguf(const std::string& checkpoint, const std::string& out, const GgufExportOptions& o) {
  const torch::ScalarType dtype = parse_dtype_option(o.dtype, kGgufDtypes, "export --format gguf");
  const auto ours = check_export_target(checkpoint, out, "export", o.force);
  // What the metadata decides is checked before the weights are read and merged.
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  const ModelOptions options = checkpoint_model_options(ck);
  const std::string arch = architecture_of(options), tokenizer = tokenizer_for(o.tokenizer, ck, options);
  check_activation(options, arch, checkpoint, "gguf");
  GgufWriter g;
  g.set_string("general.architecture", arch);
  g.set_string("general.name", model_name(checkpoint, ck));
  set_hyperparameters(g, arch, options, ck);
  const std::optional<ChatFormat> chat = chat_format(ck, options);
  set_tokenizer(g, tokenizer, options, chat);
  MergedWeights w = merged_weights(checkpoint, o.use_ema, o.base, dtype, "export --format gguf");
  g.set_u32("general.file_type", file_type(w.dtype));
  bool has_head = false;
  torch::Tensor embedding;
  for (const auto& [name, t] : w.params) {
    const std::string gg = gguf_name(options.family, name);
    if (gg.empty())
      throw UserError("export --format gguf: " + checkpoint + " has a parameter " + name + " that llama.cpp's " + arch +
                      " has no tensor for. Nothing was written");
    const int64_t heads = permuted_heads(arch, gg, options);
    torch::Tensor v = heads ? permute_rows(t, heads) : t;
    g.add_tensor(gg, v.dim() == 1 ? v.to(torch::kFloat32) : v);  // norms and biases in f32, as the converter writes them
    has_head = has_head || gg == "output.weight";
    if (gg == "token_embd.weight") embedding = v;
  }
  // A tied head: llama.cpp's gpt2 reads output.weight, which the converter writes as a copy of the
  // embedding; llama and qwen2 use token_embd when output is absent.
  if (!has_head && arch == "gpt2") g.add_tensor("output.weight", embedding);
  add_rope_factors(g, options);
  publish_dir(out, [&](const fs::path& dir) {
    g.write((dir / "model.gguf").string());
    write_export_marker(dir, checkpoint, "gguf");
    if (o.check) o.check((dir / "model.gguf").string());  // a failed check publishes nothing
  }, "", ours, export_owner(checkpoint));
  std::printf("exported %s -> %s/model.gguf (GGUF for llama.cpp: architecture %s, %zu tensors, %s, adapters merged; "
              "tokenizer %s%s)\n",
              checkpoint.c_str(), out.c_str(), arch.c_str(), g.tensor_count(), dtype_name(w.dtype).c_str(), tokenizer.c_str(),
              chat ? "; the chat template it was trained with" : "");
}

void export_gguf_adapter(const std::string& checkpoint, const std::string& out, const GgufExportOptions& o) {
  const torch::ScalarType dtype = parse_dtype_option(o.dtype, kGgufDtypes, "export --format gguf-adapter");
  const auto ours = check_export_target(checkpoint, out, "export", o.force);
  const CheckpointMeta ck = CheckpointMeta::read(checkpoint);
  if (ck.kind != StateKind::Lora || !ck.lora)
    throw UserError("export --format gguf-adapter: " + checkpoint + " is a " + state_kind_name(ck.kind) +
                    " checkpoint without adapters; an adapter comes from a LoRA-phase checkpoint (for the whole model "
                    "use --format gguf). Nothing was written");
  const LoraMetadata& l = *ck.lora;
  std::vector<std::string> unsupported;
  if (l.dora) unsupported.push_back("DoRA (optimization/lora/dora)");
  if (!l.modules_to_save.empty()) unsupported.push_back("modules_to_save (" + join(l.modules_to_save) + ")");
  if (!l.trainable_tokens.empty()) unsupported.push_back("trainable token rows (optimization/lora/trainable_token_indices)");
  if (!unsupported.empty())
    throw UserError("export --format gguf-adapter: " + checkpoint + " has " + join(unsupported, " and ") +
                    ", which a llama.cpp LoRA adapter cannot hold; export the merged model with --format gguf instead. "
                    "Nothing was written");
  if (l.targets.empty())
    throw UserError("export --format gguf-adapter: " + checkpoint + " holds no adapters yet (a checkpoint saved before its "
                    "LoRA phase began: lora.targets is empty); export one of the LoRA phase. Nothing was written");
  const ModelOptions options = checkpoint_model_options(ck);
  const std::string arch = architecture_of(options);
  check_activation(options, arch, checkpoint, "gguf-adapter");
  ParamTensors params = param_tensors(export_tensors(ck, o.use_ema, o.base, /*base_values=*/false));
  const torch::ScalarType out_dtype = dtype == c10::ScalarType::Undefined ? torch::kFloat32 : dtype;
  // rsLoRA scales by alpha / sqrt(r), llama.cpp by alpha / r: the same product with alpha * sqrt(r).
  const double alpha = l.rslora ? l.alpha * std::sqrt(static_cast<double>(l.rank)) : l.alpha;
  GgufWriter g;
  g.set_string("general.architecture", arch);
  g.set_string("general.type", "adapter");
  g.set_string("general.name", model_name(checkpoint, ck));
  g.set_string("adapter.type", "lora");
  g.set_f32("adapter.lora.alpha", static_cast<float>(alpha));
  for (const auto& target : l.targets) {
    auto a = params.adapters.find(LoraParams::a_name(target)), b = params.adapters.find(LoraParams::b_name(target));
    if (a == params.adapters.end() || b == params.adapters.end())
      throw UserError(checkpoint + ": the adapter of " + target + " is missing (params/" + LoraParams::a_name(target) +
                      "). Nothing was written");
    const std::string gg = gguf_name(options.family, target);
    if (gg.empty())
      throw UserError("export --format gguf-adapter: " + checkpoint + " adapts " + target + ", which llama.cpp's " + arch +
                      " has no tensor for. Nothing was written");
    auto W = std::find_if(params.base.begin(), params.base.end(), [&](const auto& p) { return p.first == target; });
    if (W == params.base.end())
      throw UserError(checkpoint + ": adapted weight " + target + " is not among its parameters (params/" + target +
                      "). Nothing was written");
    check_adapter_shapes(target, W->second, a->second, b->second, l.rank);
    // Ours: A (in, r), B (r, out); llama.cpp's lora_a is PEFT's lora_A (r, in), lora_b its lora_B (out, r).
    torch::Tensor lora_a = a->second.to(torch::kFloat32).t().contiguous();
    torch::Tensor lora_b = b->second.to(torch::kFloat32).t().contiguous();
    if (const int64_t heads = permuted_heads(arch, gg, options)) lora_b = permute_rows(lora_b, heads);
    const std::string command = "export --format gguf-adapter";
    g.add_tensor(gg + ".lora_a", export_cast(lora_a, out_dtype, kParamsPrefix + a->first + " (" + gg + ".lora_a)", command));
    g.add_tensor(gg + ".lora_b", export_cast(lora_b, out_dtype, kParamsPrefix + b->first + " (" + gg + ".lora_b)", command));
  }
  publish_dir(out, [&](const fs::path& dir) {
    g.write((dir / "adapter.gguf").string());
    write_export_marker(dir, checkpoint, "gguf-adapter");
  }, "", ours, export_owner(checkpoint));
  std::printf("exported %s -> %s/adapter.gguf (llama.cpp LoRA adapter for architecture %s: %zu adapted weights, rank "
              "%lld, alpha %g%s, %s)\n",
              checkpoint.c_str(), out.c_str(), arch.c_str(), l.targets.size(), (long long)l.rank, alpha,
              l.rslora ? " (rsLoRA's alpha * sqrt(r))" : "", dtype_name(out_dtype).c_str());
}

}  // namespace lt
