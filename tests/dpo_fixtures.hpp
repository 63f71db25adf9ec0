// Shared DPO test helpers: a toy preference set ("after any prompt, ` good.` is preferred to ` bad!`")
// tokenized as a contrastive dataset, beside a generated text dataset.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fixtures.hpp"
#include "lora_trainer/core/outputs.hpp"

namespace lt::test {

// The preference pairs as a job samples them.
inline const Sampling kPrefs{"prefs", 1.0, DatasetStyle::CONTRASTIVE};

// Writes `records` (JSONL) and tokenizes them as the contrastive dataset `name` (byte tokenizer, a
// quarter of the pairs for validation).
inline TokenizeResult make_pairs(const TempDir& dir, const std::string& records, const std::string& name = "prefs") {
  write_file_atomic(dir / (name + ".jsonl"), records);
  TokenizeOptions o;
  o.inputs = {dir / (name + ".jsonl")};
  o.out_dir = dir / ("data/" + name);
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  return tokenize_jsonl_to_contrastive(o);
}

// A toy preference: after any prompt, " good." is preferred to " bad!".
inline std::string toy_records(int n) {
  std::string out;
  for (int i = 0; i < n; ++i)
    out += nlohmann::json({{"prompt", "Q" + std::to_string(i % 7) + std::string(1, static_cast<char>('a' + i % 5)) + ":"},
                           {"chosen", " good."},
                           {"rejected", " bad!"}})
               .dump() +
           "\n";
  return out;
}

// data/ holds "prefs" (40 toy pairs, contrastive) and "gen" (generated text, pmd).
struct PrefData {
  TempDir dir;
  PrefData() {
    make_pairs(dir, toy_records(40));
    make_byte_dataset(dir / "data", "gen", 1);
  }
};

}  // namespace lt::test
