// A model directory and a model trained on conversations, for the tests of shipping and chatting with
// chat models: the small Qwen2-layout tokenizer (<|im_start|>, <|im_end|> special), the test ChatML
// template with {% generation %} tags, eos_token <|im_end|>, and a generation_config.json.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "fixtures.hpp"
#include "launch.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt::test {

// The model directory under `tmp`: tokenizer.json, tokenizer_config.json, generation_config.json.
inline std::string chat_model_dir(const TempDir& tmp) {
  namespace fs = std::filesystem;
  const std::string src = LT_SOURCE_DIR;
  const fs::path dir = tmp / "model";
  fs::create_directories(dir);
  fs::copy_file(src + "/tests/data/hf_tokenizers/qwen2/tokenizer.json", dir / "tokenizer.json");
  const nlohmann::ordered_json config = {{"eos_token", "<|im_end|>"},
                                         {"bos_token", nullptr},
                                         {"chat_template", read_file(src + "/tests/data/chat_templates/with_generation.jinja")}};
  write_file_atomic((dir / "tokenizer_config.json").string(), config.dump(1));
  write_file_atomic((dir / "generation_config.json").string(), R"({"eos_token_id": [2, 0], "temperature": 0.7})");
  return dir.string();
}

// The launcher's settings of a small Llama-family LoRA job without phase one on the model directory's
// vocabulary (random base: what such tests check is what the job records and how its model is used),
// reading datasets under `data`; `tokens` of the LoRA phase.
inline std::vector<std::string> chat_job_overrides(const std::string& data, int tokens = 1024) {
  std::vector<std::string> arch = tiny_overrides(data);
  for (const std::string o : {"architecture/family=llama", "architecture/vocab_size=704", "architecture/block_size=128",
                              "architecture/activation=silu", "training/allow_random_base=true", "training/pre_lora_tokens=[]",
                              "training/pre_lora_dataset=[]"})
    arch.push_back(o);
  arch.push_back("training/post_lora_tokens=[" + std::to_string(tokens) + "]");
  return arch;
}

// Writes `records` (chat records, JSON text), each `copies` times, to TMP/conv.jsonl and tokenizes them
// with the model directory `model` as the chat dataset "conv" under `data` (`extra`: more tokenize
// options, e.g. --loss-on last).
inline void tokenize_conversations(const TempDir& tmp, const std::string& model, const std::string& data,
                                   const std::vector<std::string>& records, int copies, const std::string& val_fraction,
                                   const std::vector<std::string>& extra = {}) {
  std::string lines;
  for (int copy = 0; copy < copies; ++copy)
    for (const auto& r : records) lines += nlohmann::ordered_json::parse(r).dump() + "\n";
  write_file_atomic(tmp / "conv.jsonl", lines);
  std::vector<std::string> args = {"tokenize", tmp / "conv.jsonl", "--format", "chat", "--tokenizer", "hf:" + model, "--name", "conv",
                                   "--data-dir", data, "--val-fraction", val_fraction, "--length", "128"};
  args.insert(args.end(), extra.begin(), extra.end());
  const Result r = launch(args);
  INFO(r.out);
  REQUIRE(r.code == 0);
}

// The dataset of tokenize_conversations as a stage list of a job (padded rows).
inline const std::string kConversations = R"([[{"name":"conv","rate":1,"style":"padded"}]])";

}  // namespace lt::test
