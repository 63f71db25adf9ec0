#include "lora_trainer/cli/commands/export_check.hpp"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "lora_trainer/cli/commands/command.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/subprocess.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/byte_level_bpe.hpp"
#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/tokenize.hpp"
#include "lora_trainer/formats/base_weights.hpp"
#include "lora_trainer/formats/gguf.hpp"
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
torch::Tensor all_logits(CausalLM model, const torch::Device& device, const std::vector<uint32_t>& ids) {
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

// The checkpoint's side of a check: its model in float32 (what differs is the export), its tokenizer,
// chat template and end-of-turn ids, and what to check on.
struct Reference {
  std::unique_ptr<RestorableJob> job;
  Trainer* t = nullptr;
  Runtime rt;
  std::unique_ptr<Tokenizer> tok;
  std::optional<ChatSetup> chat;
  std::vector<uint32_t> stops;
  std::vector<Prompt> prompts;
  CausalLM model{nullptr};

  Reference(const std::string& checkpoint, const ExportCheckOptions& o) {
    job = load_for_reading(checkpoint, o.overrides, &t);
    rt = t->runtime();
    rt.bf16_autocast = false;
    const std::string tokenizer_name = o.tokenizer == "auto" ? t->tokenizer_name("check-export") : o.tokenizer;
    tok = make_tokenizer(tokenizer_name);
    const nlohmann::json recorded = t->provenance().model_chat_format();
    if (!recorded.is_null()) chat = chat_setup(recorded, tokenizer_name, *tok, "check-export");
    stops = chat ? chat->stop_ids : std::vector<uint32_t>{tok->eot_id()};
    prompts = o.prompts.empty() ? built_in_prompts(bool(chat)) : read_prompts(o.prompts, bool(chat));
    model = t->model();  // the trained values, as the export writes them (export --check refuses --ema)
    model->eval();
  }
};

// One prompt through the checkpoint: the text its template renders, its tokens (`ids`; `used`, the last
// of them that fit the model's block with the reply), the greedy reply to it (`seq`: `used` and the
// reply), and the checkpoint's logits over `seq` but its last token (`logits`, (positions, V)).
struct Case {
  const Prompt* prompt = nullptr;
  std::string text, cut;
  std::vector<uint32_t> ids, used, seq;
  bool ended = false;
  torch::Tensor logits;
  int64_t first() const { return static_cast<int64_t>(used.size()) - 1; }  // the row after the prompt
};

Case render(Reference& ref, const Prompt& p, const ExportCheckOptions& o) {
  Case c;
  c.prompt = &p;
  c.text = ref.chat ? ref.chat->tmpl.render(p.messages, true).text : p.text;
  c.ids = ref.tok->encode(c.text);
  if (c.ids.empty()) throw UserError(p.where + ": the prompt encodes to no tokens");
  const int64_t block = ref.model->options().block_size, room = block - o.reply_tokens;
  c.used = c.ids;
  if (static_cast<int64_t>(c.ids.size()) > room) {
    if (!o.prompts.empty() || room < 1)
      throw UserError(p.where + ": the prompt is " + std::to_string(c.ids.size()) + " tokens; with a reply of " +
                      std::to_string(o.reply_tokens) + " it does not fit the model's block of " + std::to_string(block) +
                      " (give shorter prompts, or fewer reply tokens)");
    c.cut = " (its last " + std::to_string(room) + " of " + std::to_string(c.ids.size()) + ", the model's block)";
    c.used.erase(c.used.begin(), c.used.end() - room);  // a built-in prompt past a small model's block
  }
  return c;
}

// The checkpoint's greedy reply, step by step; the last step's logits are over the whole context.
void reply(Reference& ref, Case& c, const ExportCheckOptions& o) {
  c.seq = c.used;
  for (int64_t k = 0; k < o.reply_tokens && !c.ended; ++k) {
    c.logits = all_logits(ref.model, ref.rt.device, c.seq);
    const uint32_t next = static_cast<uint32_t>(c.logits[-1].slice(0, 0, ref.tok->vocab_size()).argmax().item<int64_t>());
    c.seq.push_back(next);
    c.ended = std::count(ref.stops.begin(), ref.stops.end(), next) > 0;
  }
}

// The export's logits `b` after the prompt and after each reply token (rows first().. of the case's
// positions) against the checkpoint's, within `rel_tol` of the largest, and its greedy choice token by
// token (a near tie ends the comparison). Prints the case's line.
void compare_logits(const Reference& ref, const Case& c, const torch::Tensor& b, double rel_tol, const std::string& dtype,
                    const std::string& shown, const std::string& reader) {
  const torch::Tensor a = c.logits.slice(0, c.first());
  if (a.sizes() != b.sizes())
    throw ExportCheckFailed(shown + ": the exported model's logits have shape " + shape_text(b.sizes().vec()) + " in " + reader +
                            ", the checkpoint's " + shape_text(a.sizes().vec()));
  const double scale = std::max(1.0, a.abs().max().item<double>()), tol = rel_tol * scale;
  const uint32_t vocab = ref.tok->vocab_size();
  double worst = 0;
  std::string note;
  for (int64_t k = 0; k < a.size(0); ++k) {  // the reply's token k
    const double diff = (a[k] - b[k]).abs().max().item<double>();
    worst = std::max(worst, diff);
    if (!(diff <= tol))
      throw ExportCheckFailed(c.prompt->where + ": the exported model's next-token logits in " + reader + " " +
                              (k == 0 ? std::string("after the prompt") : "at reply token " + std::to_string(k + 1)) +
                              " differ from the checkpoint's by " + num(diff) + " (tolerance " + num(tol) + " for " + dtype +
                              " weights, logits up to " + num(scale) +
                              "): the export does not compute the checkpoint's model (an adapter left out, another base?)");
    const torch::Tensor ra = a[k].slice(0, 0, vocab), rb = b[k].slice(0, 0, vocab);
    const int64_t mine = ra.argmax().item<int64_t>(), yours = rb.argmax().item<int64_t>();
    if (mine != yours) {
      const auto top = std::get<0>(ra.topk(2));
      if ((top[0] - top[1]).item<double>() > 2 * tol)
        throw ExportCheckFailed(c.prompt->where + ": reply token " + std::to_string(k + 1) + ": the checkpoint writes " +
                                std::to_string(mine) + " (" + quoted(ref.tok->decode({static_cast<uint32_t>(mine)})) + "), " +
                                reader + " " + std::to_string(yours) + " (" +
                                quoted(ref.tok->decode({static_cast<uint32_t>(yours)})) + ")");
      note = "; a near tie at reply token " + std::to_string(k + 1) + ", the rest not compared";
      break;
    }
  }
  std::printf("  %s: %zu prompt tokens alike%s, a reply of %zu tokens alike (%s), logits within %.2g%s\n", c.prompt->where.c_str(),
              c.ids.size(), c.cut.c_str(), c.seq.size() - c.used.size(), c.ended ? "ended at its end of turn" : "the limit", worst,
              note.c_str());
}

std::string id_list(const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) s += (s.empty() ? "" : ", ") + std::to_string(id);
  return "[" + s + "]";
}

// Where two token sequences first differ, each side's token shown as the checkpoint's tokenizer reads it.
std::string token_difference(const Tokenizer& tok, const std::vector<uint32_t>& theirs, const std::vector<uint32_t>& ours) {
  size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
  auto at = [&](const std::vector<uint32_t>& v) {
    return i < v.size() ? std::to_string(v[i]) + " (" + quoted(tok.decode({v[i]})) + ")" : std::string("the end");
  };
  return "at position " + std::to_string(i) + " " + at(theirs) + " where the checkpoint has " + at(ours);
}

}  // namespace

void check_hf_export(const std::string& dir, const std::string& checkpoint, const ExportCheckOptions& o, const std::string& shown) {
  if (!is_hf_model_dir(dir))
    throw UserError(shown + " is not a Hugging Face export (a config.json and no metadata.json): check-export checks what "
                    "`export --format hf` and `--format gguf` write");
  Reference ref(checkpoint, o);
  Trainer* t = ref.t;

  // The export as transformers would read it, through our readers.
  const std::string config_path = (fs::path(dir) / "config.json").string();
  Config described = t->config();  // the checkpoint's, with what config.json says in place of its architecture
  for (const auto& setting : hf_architecture(read_json_file(config_path), config_path))
    if (setting.rfind("architecture/block_size=", 0) != 0) described.apply_override(setting);
  const ModelOptions ours_options = ref.model->options(), theirs_options = ModelOptions::from_config(described);
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
    theirs->to(ref.rt.device);
    theirs->eval();
  }
  const double rel_tol = relative_tolerance(src->dtype());
  const bool has_tokenizer = fs::exists(fs::path(dir) / "tokenizer.json");
  std::unique_ptr<Tokenizer> their_tok = has_tokenizer ? make_tokenizer("hf:" + dir) : nullptr;
  std::optional<ChatTemplate> their_tmpl;
  if (ref.chat) {
    if (!their_tok)
      throw ExportCheckFailed(shown + " holds no tokenizer.json: the model was trained on chat data, and transformers needs "
                              "its tokenizer and chat template beside the weights");
    their_tmpl = ChatTemplate::from_model_dir(dir);
    const std::vector<uint32_t> their_stops = chat_format_of(*their_tmpl, dir, *their_tok).stop_ids;
    if (their_stops != ref.stops)
      throw ExportCheckFailed(shown + ": its end-of-turn ids (tokenizer_config.json's eos_token, then generation_config.json's "
                              "eos_token_id) are " + id_list(their_stops) + ", the checkpoint's " + id_list(ref.stops) +
                              " (metadata.json chat.stop_ids): a reply would not stop where the model learned to");
  }
  std::printf("checking %s against %s: %zu %s, replies of up to %lld tokens, logits within %.0e of the largest for %s "
              "weights (the export read back by lora_trainer's own readers)\n",
              shown.c_str(), checkpoint.c_str(), ref.prompts.size(), ref.chat ? "conversations" : "prompts", (long long)o.reply_tokens,
              rel_tol, src->dtype().c_str());
  for (const Prompt& p : ref.prompts) {
    Case c = render(ref, p, o);
    if (ref.chat) {
      const std::string theirs_text = their_tmpl->render(p.messages, true).text;
      if (theirs_text != c.text)
        throw ExportCheckFailed(p.where + ": the exported chat template (" + shown + "/tokenizer_config.json) renders another text " +
                                first_difference(theirs_text, c.text));
    }
    if (their_tok) {
      const std::vector<uint32_t> their_ids = their_tok->encode(c.text);
      if (their_ids != c.ids)
        throw ExportCheckFailed(p.where + ": the exported tokenizer (" + shown + "/tokenizer.json) gives other ids: " +
                                token_difference(*ref.tok, their_ids, c.ids));
    }
    reply(ref, c, o);
    const torch::Tensor b = all_logits(theirs, ref.rt.device, std::vector<uint32_t>(c.seq.begin(), c.seq.end() - 1));
    compare_logits(ref, c, b.slice(0, c.first()), rel_tol, src->dtype(), shown, "the export");
  }
  std::printf("check passed: %s reproduces %s (template, tokenizer, end of turn, logits and greedy replies)\n", shown.c_str(),
              checkpoint.c_str());
}


namespace {

// Where node-llama-cpp may be installed, in order: $LT_LLAMA_CPP_DIR, datasets/cache/llama_cpp under the
// working directory (scripts/fetch_llama_cpp.sh's place, from the source tree), and that place beside
// the launcher's build directory; node's own module path after them (llama_cpp_check.mjs).
std::vector<std::string> llama_cpp_package_dirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("LT_LLAMA_CPP_DIR"); env && *env) dirs.push_back(fs::absolute(env).string());
  dirs.push_back(fs::absolute("datasets/cache/llama_cpp").string());
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back((exe.parent_path().parent_path() / "datasets/cache/llama_cpp").string());
  return dirs;
}

// GGUF's general.file_type (llama_ftype) of an unquantized file: the dtype of its weights; "" for others.
std::string gguf_dtype(int64_t file_type) {
  return file_type == 0 ? "float32" : file_type == 1 ? "float16" : file_type == 32 ? "bfloat16" : "";
}

// The last `n` lines of a program's errors that say something, joined by " | ".
std::string last_lines(const std::string& text, size_t n) {
  std::vector<std::string> lines;
  size_t b = 0;
  while (b < text.size()) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    if (text.find_first_not_of(" \t\r", b) < e) lines.push_back(text.substr(b, e - b));
    b = e + 1;
  }
  if (lines.size() > n) lines.erase(lines.begin(), lines.end() - n);
  return lines.empty() ? std::string("(nothing on stderr)") : join(lines, " | ");
}

}  // namespace

extern const char* const kLlamaCppCheckScript;  // llama_cpp_check.mjs, carried in the launcher (CMakeLists.txt)

void check_gguf_export(const std::string& file, const std::string& checkpoint, const ExportCheckOptions& o, const std::string& shown) {
  GgufFileInfo info;
  try {  // llama.cpp's reader trusts the file: a truncated or damaged one is named here first
    info = read_gguf_info(file);
  } catch (const UserError& e) {
    throw ExportCheckFailed(e.what());
  }
  const std::string dtype = gguf_dtype(info.file_type);
  if (dtype.empty())
    throw UserError(shown + " is quantized or of another kind (general.file_type " + std::to_string(info.file_type) +
                    "): check-export compares the unquantized exports of `export --format gguf` (float32, float16, bfloat16)");
  // llama.cpp keeps its attention cache in float16 (its default, as users run it): float16's tolerance
  // at least, whatever the weights.
  const double rel_tol = std::max(relative_tolerance(dtype), relative_tolerance("float16"));
  // Whether llama.cpp can run here at all, before the checkpoint is loaded and its replies generated.
  TempDirectory tmp("check-export");
  write_file_atomic(tmp / "llama_cpp_check.mjs", kLlamaCppCheckScript);
  auto run_node = [&](int timeout_s) {  // the script on tmp/request.json
    return run_process({"node", tmp / "llama_cpp_check.mjs", tmp / "request.json"}, tmp / "response.json", tmp / "stderr.txt",
                       timeout_s);
  };
  write_file_atomic(tmp / "request.json", ojson{{"probe", true}, {"package_dirs", llama_cpp_package_dirs()}}.dump());
  const ProcessResult probe = run_node(120);
  const std::string skipped = "check skipped: " + shown + " was not read back by llama.cpp: ";
  const std::string install = " (from the source tree, `bash scripts/fetch_llama_cpp.sh` installs node-llama-cpp in "
                              "datasets/cache/llama_cpp; or set LT_LLAMA_CPP_DIR to a directory holding "
                              "node_modules/node-llama-cpp)";
  if (!probe.started) {
    std::printf("%s%s: Node.js 20+ is needed (Debian: apt-get install nodejs)%s\n", skipped.c_str(), probe.error.c_str(),
                install.c_str());
    return;
  }
  if (probe.exit_code == 4) {
    std::printf("%s%s%s\n", skipped.c_str(), last_lines(read_file(tmp / "stderr.txt"), 1).c_str(), install.c_str());
    return;
  }
  if (probe.exit_code != 0 || probe.timed_out)
    throw ExportCheckFailed(shown + ": node could not start node-llama-cpp (exit status " + std::to_string(probe.exit_code) +
                            "): " + last_lines(read_file(tmp / "stderr.txt"), 4));
  Reference ref(checkpoint, o);
  if (ref.chat && !info.has_chat_template)
    throw ExportCheckFailed(shown + " carries no tokenizer.chat_template: the model was trained on chat data, and llama.cpp's "
                            "chat (llama-server --jinja, llama-cli -cnv, ollama) needs the template it was trained with");
  std::vector<Case> cases;
  for (const Prompt& p : ref.prompts) {
    cases.push_back(render(ref, p, o));
    reply(ref, cases.back(), o);
  }
  // llama.cpp's side, in one run of node: the file's template and tokens for each prompt, its end-of-
  // generation ids, and its logits over the checkpoint's prompt and greedy reply.
  ojson request = {{"model", fs::absolute(file).string()}, {"package_dirs", llama_cpp_package_dirs()},
                   {"threads", std::max<int64_t>(1, ref.rt.threads)}, {"stops", ref.stops}, {"logits", tmp / "logits.f32"},
                   {"cases", ojson::array()}};
  for (const Case& c : cases) {
    ojson item = {{"sequence", std::vector<uint32_t>(c.seq.begin(), c.seq.end() - 1)}, {"first", c.first()}};
    if (ref.chat) item["messages"] = c.prompt->messages;
    else item["text"] = c.text;
    request["cases"].push_back(std::move(item));
  }
  write_file_atomic(tmp / "request.json", request.dump());
  // Time enough to read the file from a slow disk and evaluate the prompts: 10 minutes, and 1 a GB.
  const int timeout_s = 600 + static_cast<int>(fs::file_size(file) >> 30) * 60;
  const ProcessResult run = run_node(timeout_s);
  if (run.timed_out)
    throw ExportCheckFailed(shown + ": llama.cpp (node-llama-cpp) did not answer within " + std::to_string(timeout_s) + " s: " +
                            last_lines(read_file(tmp / "stderr.txt"), 2));
  const std::string err = read_file(tmp / "stderr.txt");
  if (run.exit_code != 0)
    throw ExportCheckFailed(shown + ": " + (run.exit_code == 1 ? last_lines(err, 1) : "llama.cpp (node-llama-cpp) ended with exit status " +
                                                                            std::to_string(run.exit_code) + ": " + last_lines(err, 4)));
  const ojson response = parse_ordered_json(read_file(tmp / "response.json"), "llama.cpp's answer");
  for (size_t i = 0; i < ref.stops.size(); ++i)
    if (!response["eog"][i].get<bool>())
      throw ExportCheckFailed(shown + ": llama.cpp does not end a generation at token " + std::to_string(ref.stops[i]) + " (" +
                              quoted(ref.tok->decode({ref.stops[i]})) + "), one of the checkpoint's end-of-turn ids " +
                              id_list(ref.stops) + " (metadata.json chat.stop_ids): a reply would not stop where the model learned to");
  const int64_t vocab = response["vocab_size"].get<int64_t>();
  std::printf("checking %s against %s: %zu %s, replies of up to %lld tokens, logits within %.0e of the largest for %s "
              "weights and llama.cpp's float16 attention cache (the export read by llama.cpp, node-llama-cpp)\n",
              shown.c_str(), checkpoint.c_str(), cases.size(), ref.chat ? "conversations" : "prompts", (long long)o.reply_tokens,
              rel_tol, dtype.c_str());
  const std::string logits = read_file(tmp / "logits.f32");
  size_t offset = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::vector<uint32_t> their_ids = response["cases"][i]["prompt_tokens"].get<std::vector<uint32_t>>();
    if (their_ids != c.ids)
      throw ExportCheckFailed(c.prompt->where + ": llama.cpp " +
                              (ref.chat ? std::string("renders the conversation through the file's tokenizer.chat_template and "
                                                      "tokenizes it into other ids: ")
                                        : std::string("tokenizes the prompt into other ids: ")) +
                              token_difference(*ref.tok, their_ids, c.ids));
    const int64_t rows = static_cast<int64_t>(c.seq.size()) - 1 - c.first();
    const size_t bytes = static_cast<size_t>(rows * vocab) * sizeof(float);
    if (offset + bytes > logits.size())
      throw ExportCheckFailed(shown + ": llama.cpp gave fewer logits than asked (" + std::to_string(logits.size()) + " bytes)");
    const torch::Tensor b =
        torch::from_blob(const_cast<char*>(logits.data() + offset), {rows, vocab}, torch::kFloat32).clone();
    offset += bytes;
    compare_logits(ref, c, b, rel_tol, dtype, shown, "llama.cpp");
  }
  std::printf("check passed: %s reproduces %s in llama.cpp (template, tokens, end of generation, logits and greedy replies)\n",
              shown.c_str(), checkpoint.c_str());
}

}  // namespace lt
