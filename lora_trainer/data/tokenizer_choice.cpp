#include "lora_trainer/data/tokenizer_choice.hpp"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "lora_trainer/core/util.hpp"

namespace fs = std::filesystem;

namespace lt {

namespace {

const char* kPass = "pass --tokenizer hf:DIR (the directory of the tokenizer.json its training data was tokenized with), "
                    "gpt2 or byte";

// A named hf:DIR must still hold its tokenizer.json: a tokenizer found elsewhere may be another.
std::string checked(const std::string& name, const std::string& from, const TokenizerClues& c, const std::string& command) {
  if (name.rfind("hf:", 0) != 0 || fs::exists(fs::path(name.substr(3)) / "tokenizer.json")) return name;
  throw UserError(command + " --tokenizer auto: " + c.checkpoint + " was trained on ids of the tokenizer " + name + " (" +
                  from + "), but " + name.substr(3) + "/tokenizer.json is not there (moved or deleted); " + kPass);
}

// The names of the samplings ({"name": ...}) in a config value: a mixture, or stages of mixtures.
void collect_dataset_names(const nlohmann::json& v, std::vector<std::string>& out) {
  if (v.is_array())
    for (const auto& e : v) collect_dataset_names(e, out);
  else if (v.is_object() && v.value("name", nlohmann::json()).is_string())
    out.push_back(v["name"].get<std::string>());
}

}  // namespace

TokenizerClues checkpoint_tokenizer_clues(const std::string& checkpoint, const std::string& recorded, int64_t step,
                                         const nlohmann::json& config, const std::string& hf_dir, int64_t vocab_size) {
  TokenizerClues c;
  c.checkpoint = checkpoint;
  c.vocab_size = vocab_size;
  c.recorded = recorded;
  c.trained = step > 0;
  if (config.is_object()) {
    const nlohmann::json data = config.value("data", nlohmann::json());
    if (data.is_object() && data.value("dir", nlohmann::json()).is_string()) c.data_dir = data["dir"].get<std::string>();
    const nlohmann::json training = config.value("training", nlohmann::json());
    if (training.is_object())
      for (const auto& [key, v] : training.items())
        if (key.find("dataset") != std::string::npos) collect_dataset_names(v, c.datasets);
  }
  c.hf_dir = hf_dir;
  return c;
}

namespace {

// The meta.json of each dataset among `names` under data_dir that has one holding an object, with its
// path, in the names' order.
std::vector<std::pair<std::string, nlohmann::json>> dataset_metas(const std::string& data_dir,
                                                                  const std::vector<std::string>& names) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  for (const auto& name : names) {
    const fs::path meta = fs::path(data_dir) / name / "meta.json";
    std::error_code ec;
    if (!fs::is_regular_file(meta, ec)) continue;
    nlohmann::json m = read_json_file(meta.string());
    if (m.is_object()) out.emplace_back(meta.string(), std::move(m));
  }
  return out;
}

}  // namespace

std::string datasets_tokenizer(const std::string& data_dir, const std::vector<std::string>& names) {
  std::string found, found_in;
  for (const auto& [meta, m] : dataset_metas(data_dir, names)) {
    if (!m.value("tokenizer", nlohmann::json()).is_string()) continue;
    const std::string t = m["tokenizer"].get<std::string>();
    if (found.empty()) {
      found = t;
      found_in = meta;
    } else if (t != found) {
      throw UserError("the job's datasets were tokenized with different tokenizers: " + found_in + " says " + found + ", " +
                      meta + " says " + t + "; " + kPass);
    }
  }
  return found;
}

nlohmann::json datasets_chat_format(const std::string& data_dir, const std::vector<std::string>& names) {
  nlohmann::json found;
  std::string found_in;
  auto without_from = [](nlohmann::json chat) {  // where each template was read from aside
    chat.erase("from");
    return chat;
  };
  for (const auto& [meta, m] : dataset_metas(data_dir, names)) {
    if (!m.contains("chat") || !m["chat"].is_object()) continue;
    if (found.is_null()) {
      found = m["chat"];
      found_in = meta;
    } else if (without_from(m["chat"]) != without_from(found)) {
      throw UserError("the job's datasets of conversations were rendered with different chat templates or stop tokens: " +
                      found_in + " (from " + found.value("from", std::string("?")) + ") and " + meta + " (from " +
                      m["chat"].value("from", std::string("?")) + ")");
    }
  }
  return found;
}

std::string auto_tokenizer(const TokenizerClues& c, const std::string& command) {
  if (!c.recorded.empty()) return checked(c.recorded, "its metadata.json: tokenizer", c, command);
  if (c.trained) {
    const std::string t = datasets_tokenizer(c.data_dir, c.datasets);
    if (!t.empty()) return checked(t, "its datasets' meta.json under " + c.data_dir, c, command);
  }
  if (!c.hf_dir.empty() && fs::exists(fs::path(c.hf_dir) / "tokenizer.json")) return "hf:" + c.hf_dir;
  if (c.vocab_size == 257) return "byte";
  // GPT-2's 50257 tokens, or that vocabulary padded to a multiple of 64: no other tokenizer has that size.
  if (c.vocab_size >= 50257 && c.vocab_size <= 50304) return "gpt2";
  std::string why = "its metadata records no tokenizer";
  if (c.trained) why += ", its datasets (" + join(c.datasets) + " under " + c.data_dir + ") are not there to say";
  if (!c.hf_dir.empty()) why += ", its imported model's directory " + c.hf_dir + " holds no tokenizer.json";
  throw UserError(command + " --tokenizer auto: cannot tell which tokenizer " + c.checkpoint + " reads text with (" + why +
                  ", and a vocabulary of " + std::to_string(c.vocab_size) + " is neither the byte tokenizer's nor GPT-2's); " +
                  kPass);
}

}  // namespace lt
