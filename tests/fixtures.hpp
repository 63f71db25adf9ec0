// Shared test helpers: temporary directories, a small byte-tokenized dataset made from generated
// text, and tiny trainer configs.
#pragma once

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

#include "lora_trainer/config.hpp"
#include "lora_trainer/trainer.hpp"
#include "lora_trainer/tokenize.hpp"
#include "lora_trainer/util.hpp"

namespace lt::test {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("lt-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    remove_tree(path.string());
  }
  std::string str() const { return path.string(); }
  std::string operator/(const std::string& rel) const { return (path / rel).string(); }
};

// Deterministic pseudo-English text: enough structure for a loss to fall.
inline std::string generated_text(uint64_t seed, size_t words) {
  static const std::vector<std::string> vocab = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran",
                                                 "to", "house", "of", "we", "see", "it", "red", "big", "small"};
  std::mt19937_64 rng(seed);
  std::string out;
  for (size_t i = 0; i < words; ++i) {
    out += vocab[rng() % vocab.size()];
    out += (i % 12 == 11) ? ".\n" : " ";
  }
  return out;
}

// Writes `docs` generated documents and tokenizes them (byte tokenizer) as dataset `name` under data_dir.
inline void make_byte_dataset(const std::string& data_dir, const std::string& name, uint64_t seed, int docs = 8,
                              size_t words = 1500) {
  std::filesystem::path src = std::filesystem::path(data_dir) / ("src-" + name);
  std::filesystem::create_directories(src);
  for (int d = 0; d < docs; ++d)
    write_file_atomic((src / ("doc" + std::to_string(d) + ".txt")).string(), generated_text(seed * 100 + d, words));
  TokenizeOptions o;
  o.inputs = {src.string()};
  o.out_dir = (std::filesystem::path(data_dir) / name).string();
  o.tokenizer = "byte";
  o.val_fraction = 0.25;
  tokenize_to_pmd(o);
}

// A tiny GPT on byte tokens (128 tokens a step); a few steps take well under a second.
inline std::vector<std::string> tiny_overrides(const std::string& data_dir) {
  return {"architecture/vocab_size=257", "architecture/n_layers=2", "architecture/d_model=32",
          "architecture/n_heads=2",      "architecture/block_size=32", "training/batch_size=4",
          "data/dir=\"" + data_dir + "\"", "logging/report_interval=1000",
          "logging/checkpoint_interval=1000", "logging/validation_interval=1000", "training/validation_steps=4",
          "runtime/threads=2"};
}

// Both trainers hold bit-identical state: every tensor a checkpoint would store, by name and order.
inline void require_same_state(BaseTrainer& a, BaseTrainer& b) {
  auto sa = a.state_tensors(), sb = b.state_tensors();
  REQUIRE(sa.size() == sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    INFO(sa[i].first);
    REQUIRE(sa[i].first == sb[i].first);
    CHECK(torch::equal(sa[i].second, sb[i].second));
  }
}

}  // namespace lt::test
