#include "lora_trainer/cli/commands/export_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/byte_level_bpe.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/training/conversation.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace fs = std::filesystem;

namespace lt {
namespace {

using ojson = nlohmann::ordered_json;

// What one check runs on: a conversation (chat) or a text (a plain model), and where it came from.
struct Prompt {
  std::string where;
  ojson messages;
  std::string text;
};

std::vector<Prompt> built_in_prompts(bool chat) {
  std::vector<Prompt> out;
  if (chat) {
    for (const char* c : {R"([{"role": "user", "content": "Hello! Who are you?"}])",
                          R"([{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                              {"role": "user", "content": "What is the capital of France?"}])",
                          R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
                              {"role": "user", "content": "Tell me a short story about a cat."}])"})
      out.push_back({"built-in conversation " + std::to_string(out.size() + 1), ojson::parse(c), ""});
  } else {
    for (const char* t : {"The meaning of life is", "Once upon a time, in a small village,", "def fibonacci(n):\n"})
      out.push_back({"built-in prompt " + std::to_string(out.size() + 1), nullptr, t});
  }
  return out;
}

std::vector<Prompt> read_prompts(const std::string& file, bool chat) {
  std::vector<Prompt> out;
  const std::string text = read_file(file);
  size_t line_no = 0, b = 0;
  while (b < text.size()) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    const std::string line = text.substr(b, e - b);
    b = e + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = file + ":" + std::to_string(line_no);
    const ojson record = parse_ordered_json(line, where);
    if (chat) {
      ojson messages = chat_messages(record, where);
      if (!record.contains("messages")) messages.erase(messages.size() - 1);  // {"prompt", "completion"}: the prompt
      out.push_back({where, std::move(messages), ""});
    } else {
      if (!record.is_object() || !record.contains("text") || !record["text"].is_string() || record["text"].get<std::string>().empty())
        throw UserError(where + ": a model trained without a chat template is checked on texts: give {\"text\": \"...\"}");
      out.push_back({where, nullptr, record["text"].get<std::string>()});
    }
  }
  if (out.empty()) throw UserError(file + ": no prompts in it (a JSON object a line)");
  return out;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

// A text in a message: quoted, escaped, its bytes that are no UTF-8 made U+FFFD.
std::string quoted(const std::string& s) { return nlohmann::json(bpe::sanitize_utf8(s)).dump(); }

// The first byte at which two texts differ, shown with a little of each.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  auto near = [&](const std::string& s) { return quoted(s.substr(i, 40)); };
  return "at byte " + std::to_string(i) + ": " + near(a) + " where the checkpoint's has " + near(b);
}

// The model's f32 next-token logits at every position of `ids`, (positions, V), on the CPU.
torch::Tensor all_logits(CausalLM& model, const torch::Device& device, const std::vector<uint32_t>& ids) {
  torch::NoGradGuard ng;
  std::vector<int64_t> v(ids.begin(), ids.end());
  const torch::Tensor x = torch::tensor(v, torch::kLong).unsqueeze(0).to(device);
  return model->forward(x)[0].to(torch::kCPU, torch::kFloat32);
}

// How far apart the export's logits may be from the checkpoint's, per unit of the largest logit: the
// rounding of its weights (float32: the merge's only; bfloat16: 8 bits of mantissa; float16: 11).
double relative_tolerance(const std::string& dtype) {
  if (dtype == "bfloat16") return 3e-2;
  if (dtype == "float16") return 1e-2;
  return 1e-3;
}

}  // namespace

void check_hf_export(const std::string& dir, const std::string& checkpoint, const ExportCheckOptions& o, const std::string& shown) {
  if (!is_hf_model_dir(dir))
    throw UserError(shown + " is not a Hugging Face export (a config.json and no metadata.json): check-export checks what "
                    "`export --format hf` writes");
  Trainer* t = nullptr;
  auto job = load_for_reading(checkpoint, o.overrides, &t);
  Runtime rt = t->runtime();
  rt.bf16_autocast = false;  // both sides in float32: what differs is the export
  const std::string tokenizer_name = t->tokenizer_name("check-export");
  const auto tok = make_tokenizer(tokenizer_name);
  const nlohmann::json recorded = t->provenance().model_chat_format();
  const bool chat = !recorded.is_null();
  std::optional<ChatSetup> ours_chat;
  if (chat) ours_chat = chat_setup(recorded, tokenizer_name, *tok, "check-export");
  const std::vector<Prompt> prompts = o.prompts.empty() ? built_in_prompts(chat) : read_prompts(o.prompts, chat);

  // The export as transformers would read it, through our readers.
  const std::string config_path = (fs::path(dir) / "config.json").string();
  Config described = t->config();  // the checkpoint's, with what config.json says in place of its architecture
  for (const auto& setting : hf_architecture(read_json_file(config_path), config_path))
    if (setting.rfind("architecture/block_size=", 0) != 0) described.apply_override(setting);
  const ModelOptions ours_options = t->model()->options(), theirs_options = ModelOptions::from_config(described);
  std::vector<std::string> differ;  // the resolved values (n_kv_heads -1 is n_heads), as the models compute
  auto compare = [&](const std::string& key, const std::string& ours, const std::string& theirs) {
    if (ours != theirs) differ.push_back("architecture/" + key + " " + theirs + " (the checkpoint's " + ours + ")");
  };
  compare("family", to_string(ours_options.family), to_string(theirs_options.family));
  for (const auto& [key, a, b] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"vocab_size", ours_options.vocab_size, theirs_options.vocab_size}, {"n_layers", ours_options.n_layer, theirs_options.n_layer},
           {"n_heads", ours_options.n_head, theirs_options.n_head}, {"n_kv_heads", ours_options.kv_heads(), theirs_options.kv_heads()},
           {"d_model", ours_options.d_model, theirs_options.d_model}, {"d_ff", ours_options.ff(), theirs_options.ff()}})
    compare(key, std::to_string(a), std::to_string(b));
  compare("activation", activation_name(ours_options.activation), activation_name(theirs_options.activation));
  compare("norm_eps", num(ours_options.norm_eps), num(theirs_options.norm_eps));
  compare("rope_theta", num(ours_options.rope_theta), num(theirs_options.rope_theta));
  compare("rope_scaling", rope_scaling_name(ours_options.rope_scaling.kind), rope_scaling_name(theirs_options.rope_scaling.kind));
  compare("tie_embeddings", std::to_string(ours_options.tie_embeddings), std::to_string(theirs_options.tie_embeddings));
  compare("qkv_bias", std::to_string(ours_options.qkv_bias), std::to_string(theirs_options.qkv_bias));
  if (!differ.empty())
    throw ExportCheckFailed(shown + "/config.json describes another model than " + checkpoint + ": " + join(differ, ", "));
  CausalLM theirs = make_model(theirs_options);
  const auto src = BaseWeights::open_hf(dir, theirs->options().family, base_params(*theirs));
  {
    torch::NoGradGuard ng;
    for (const auto& [name, p] : base_params(*theirs)) p.set_data(src->read(name).to(torch::kFloat32));
    theirs->to(rt.device);
    theirs->eval();
  }
  const double rel_tol = relative_tolerance(src->dtype());
  const bool has_tokenizer = fs::exists(fs::path(dir) / "tokenizer.json");
  std::unique_ptr<Tokenizer> their_tok = has_tokenizer ? make_tokenizer("hf:" + dir) : nullptr;
  std::optional<ChatTemplate> their_tmpl;
  std::vector<uint32_t> stops = {tok->eot_id()};
  if (chat) {
    if (!their_tok)
      throw ExportCheckFailed(shown + " holds no tokenizer.json: the model was trained on chat data, and transformers needs "
                              "its tokenizer and chat template beside the weights");
    their_tmpl = ChatTemplate::from_model_dir(dir);
    const std::vector<uint32_t> their_stops = chat_format_of(*their_tmpl, dir, *their_tok).stop_ids;
    stops = ours_chat->stop_ids;
    auto text = [](const std::vector<uint32_t>& ids) {
      std::string s;
      for (uint32_t id : ids) s += (s.empty() ? "" : ", ") + std::to_string(id);
      return "[" + s + "]";
    };
    if (their_stops != stops)
      throw ExportCheckFailed(shown + ": its end-of-turn ids (tokenizer_config.json's eos_token, then generation_config.json's "
                              "eos_token_id) are " + text(their_stops) + ", the checkpoint's " + text(stops) +
                              " (metadata.json chat.stop_ids): a reply would not stop where the model learned to");
  }
  std::printf("checking %s against %s: %zu %s, replies of up to %lld tokens, logits within %.0e of the largest for %s "
              "weights (the export read back by lora_trainer's own readers)\n",
              shown.c_str(), checkpoint.c_str(), prompts.size(), chat ? "conversations" : "prompts", (long long)o.reply_tokens,
              rel_tol, src->dtype().c_str());
  auto ema = t->ema_weights();
  CausalLM ours = t->model();
  ours->eval();
  const int64_t block = ours->options().block_size;
  for (const Prompt& p : prompts) {
    // The prompt, as each side renders and tokenizes it.
    std::string text = p.text;
    if (chat) {
      text = ours_chat->tmpl.render(p.messages, true).text;
      const std::string theirs_text = their_tmpl->render(p.messages, true).text;
      if (theirs_text != text)
        throw ExportCheckFailed(p.where + ": the exported chat template (" + shown + "/tokenizer_config.json) renders another text " +
                                first_difference(theirs_text, text));
    }
    std::vector<uint32_t> ids = tok->encode(text);
    if (ids.empty()) throw UserError(p.where + ": the prompt encodes to no tokens");
    std::string cut;
    const int64_t room = block - o.reply_tokens;
    if (static_cast<int64_t>(ids.size()) > room) {
      if (!o.prompts.empty() || room < 1)
        throw UserError(p.where + ": the prompt is " + std::to_string(ids.size()) + " tokens; with a reply of " +
                        std::to_string(o.reply_tokens) + " it does not fit the model's block of " + std::to_string(block) +
                        " (give shorter prompts, or fewer reply tokens)");
      cut = " (its last " + std::to_string(room) + " of " + std::to_string(ids.size()) + ", the model's block)";
    }
    if (their_tok) {
      const std::vector<uint32_t> their_ids = their_tok->encode(text);
      if (their_ids != ids) {
        size_t i = 0;
        while (i < ids.size() && i < their_ids.size() && ids[i] == their_ids[i]) ++i;
        throw ExportCheckFailed(p.where + ": the exported tokenizer (" + shown + "/tokenizer.json) gives other ids: at position " +
                                std::to_string(i) + " " + (i < their_ids.size() ? std::to_string(their_ids[i]) : "nothing") +
                                " where the checkpoint's tokenizer gives " + (i < ids.size() ? std::to_string(ids[i]) : "nothing"));
      }
    }
    if (!cut.empty()) ids.erase(ids.begin(), ids.end() - room);  // a built-in prompt past a small model's block
    // The checkpoint's greedy reply, then both models' logits over the prompt and the reply, step by step.
    // The last step's logits are the checkpoint's over the whole context (the prompt and the reply but its last token).
    std::vector<uint32_t> seq = ids;
    bool ended = false;
    torch::Tensor a;
    for (int64_t k = 0; k < o.reply_tokens && !ended; ++k) {
      a = all_logits(ours, rt.device, seq);
      const uint32_t next = static_cast<uint32_t>(a[-1].slice(0, 0, tok->vocab_size()).argmax().item<int64_t>());
      seq.push_back(next);
      ended = std::count(stops.begin(), stops.end(), next) > 0;
    }
    const torch::Tensor b = all_logits(theirs, rt.device, std::vector<uint32_t>(seq.begin(), seq.end() - 1));
    if (a.sizes() != b.sizes())
      throw ExportCheckFailed(shown + ": the exported model's logits have shape " + shape_text(b.sizes().vec()) + ", the checkpoint's " +
                              shape_text(a.sizes().vec()));
    const int64_t first = static_cast<int64_t>(ids.size()) - 1;
    const double scale = std::max(1.0, a.slice(0, first).abs().max().item<double>()), tol = rel_tol * scale;
    double worst = 0;
    std::string note;
    for (int64_t pos = first; pos < a.size(0); ++pos) {
      const int64_t k = pos - first;  // the reply's token k
      const double diff = (a[pos] - b[pos]).abs().max().item<double>();
      worst = std::max(worst, diff);
      if (!(diff <= tol))
        throw ExportCheckFailed(p.where + ": the exported model's next-token logits " +
                                (k == 0 ? std::string("after the prompt") : "at reply token " + std::to_string(k + 1)) +
                                " differ from the checkpoint's by " + num(diff) + " (tolerance " + num(tol) + " for " +
                                src->dtype() + " weights, logits up to " + num(scale) +
                                "): the export does not compute the checkpoint's model (an adapter left out, another base?)");
      const torch::Tensor ra = a[pos].slice(0, 0, tok->vocab_size()), rb = b[pos].slice(0, 0, tok->vocab_size());
      const int64_t mine = ra.argmax().item<int64_t>(), yours = rb.argmax().item<int64_t>();
      if (mine != yours) {
        const auto top = std::get<0>(ra.topk(2));
        if ((top[0] - top[1]).item<double>() > 2 * tol)
          throw ExportCheckFailed(p.where + ": reply token " + std::to_string(k + 1) + ": the checkpoint writes " + std::to_string(mine) +
                                  " (" + quoted(tok->decode({static_cast<uint32_t>(mine)})) + "), the export " +
                                  std::to_string(yours) + " (" +
                                  quoted(tok->decode({static_cast<uint32_t>(yours)})) + ")");
        note = "; a near tie at reply token " + std::to_string(k + 1) + ", the rest not compared";
        break;
      }
    }
    std::printf("  %s: %zu prompt tokens alike%s, a reply of %zu tokens alike (%s), logits within %.2g%s\n", p.where.c_str(),
                ids.size(), cut.c_str(), seq.size() - ids.size(), ended ? "ended at its end of turn" : "the limit", worst, note.c_str());
  }
  std::printf("check passed: %s reproduces %s (template, tokenizer, end of turn, logits and greedy replies)\n", shown.c_str(),
              checkpoint.c_str());
}

}  // namespace lt
