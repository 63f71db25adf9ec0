// Token datasets and the deterministic mixture sampler.
//
// A dataset is a directory `<data/dir>/<name>/` of one of two styles:
//   PMD     train.bin, val.bin: flat little-endian uint32 token ids. A sample is a window of
//           block_size + 1 tokens at a block-aligned offset: inputs are its first T tokens, targets
//           the last T.
//   PADDED  {train,val}.tokens.bin: an (N, L) uint32 matrix of left-padded rows; {train,val}.mask.bin:
//           (N, L) uint8, 1 where the token counts in the loss (e.g. a completion, not its prompt);
//           {train,val}.lengths.bin: (N) uint32, each row's tokens without its padding (datasets
//           tokenized before packing existed have none); shape.json {"train": [N, L], "val": [N, L]}.
//           A sample is one row, its last T + 1 positions (left-padded further when L < T + 1); targets
//           whose mask is 0 are ignored. With data/pack, a sample is a row of several examples
//           (packing.hpp).
//   CONTRASTIVE  PADDED's files, with the rows in pairs: row 2i is the chosen completion of preference
//           pair i, row 2i + 1 the rejected one, both the same prompt (mask 0) + completion (mask 1).
//           A sample is a pair, written as two windows side by side: inputs and targets [0, T) are the
//           chosen row's, [T, 2T) the rejected row's (rows_per_sample() == 2). Records count pairs.
//   PROMPTS PADDED's files with every mask 0, a row a prompt (its last `lengths` tokens), and beside them
//           {train,val}.records.jsonl: each row's record (the answer and any other fields a reward reads).
//           GRPO's rollouts start from them (prompts.hpp); a sample is the row as PADDED writes it.
//   meta.json  {"style": "pmd"|"padded"|"contrastive"|"prompts", "tokenizer", "vocab_size", "eot_id", counts}.
//
// Sampling is counter-based: global row g of a stage is drawn from hash(seed, stage, g), so a data
// position is one integer (the cursor: rows drawn so far). A resumed run restores the cursor and sees
// exactly the rows an uninterrupted run sees; ranks take disjoint row ranges of the same sequence.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "lora_trainer/core/dataset_style.hpp"

namespace lt {

enum class Split { Train, Val };

struct Sampling {
  std::string name;
  double rate = 1.0;
  DatasetStyle style = DatasetStyle::PMD;
};

// From a checked config value (OptType::Samplings).
std::vector<Sampling> parse_samplings(const nlohmann::json& v);
// "NAME" (pmd), "NAME:padded", "NAME:contrastive" or "NAME:prompts": a dataset named on the command line
// (eval --dataset).
Sampling parse_dataset_spec(const std::string& spec);

// A read-only memory-mapped file of uint32 tokens.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  uint64_t size() const { return n_; }
  const uint32_t* data() const { return data_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint32_t* data_ = nullptr;
  uint64_t n_ = 0;
  size_t bytes_ = 0;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Number of distinct samples of length T (+1 for the shifted target) in a split.
  virtual uint64_t num_samples(Split split, int64_t T) const = 0;
  // Writes sample `index` into inputs[0..W) and targets[0..W), W = rows_per_sample() * T; targets < 0
  // are ignored by the loss. `segments` (W entries, zeroed by the caller, or null): a packed dataset
  // writes each position's example number there (SequenceLayout, models/layers.hpp); the others leave
  // it, their sample being one sequence.
  virtual void sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const = 0;
  // Whether a sample holds several examples (packing.hpp), written with their segments.
  virtual bool packed() const { return false; }
  // Rows of T tokens in one sample: 2 for a preference pair (CONTRASTIVE), else 1.
  virtual int64_t rows_per_sample() const { return 1; }
  // UserError saying why and what to do when the split holds no sample of T tokens.
  virtual void require_samples(Split split, int64_t T) const;
  const std::string& name() const { return name_; }
  const nlohmann::json& meta() const { return meta_; }
  // UserError naming the dataset, file, position and id when a token id is >= vocab_size (or the
  // dataset was tokenized for a larger vocabulary).
  virtual void check_vocabulary(int64_t vocab_size) const = 0;

 protected:
  std::string name_;
  nlohmann::json meta_;
};

class PmdDataset : public Dataset {
 public:
  const TokenFile& tokens(Split s) const { return file(s); }
  PmdDataset(const std::string& dir, const std::string& name);
  uint64_t num_samples(Split split, int64_t T) const override;
  void sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const override;
  // A token file shorter than T + 1.
  void require_samples(Split split, int64_t T) const override;
  void check_vocabulary(int64_t vocab_size) const override;

 private:
  const TokenFile& file(Split s) const { return s == Split::Train ? *train_ : *val_; }
  std::unique_ptr<TokenFile> train_, val_;
};

class PaddedDataset : public Dataset {
 public:
  PaddedDataset(const std::string& dir, const std::string& name) : PaddedDataset(dir, name, DatasetStyle::PADDED) {}
  ~PaddedDataset() override;
  uint64_t num_samples(Split split, int64_t T) const override;
  void sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const override;
  void check_vocabulary(int64_t vocab_size) const override;
  // Row `row` of a split as one sample of T tokens: its last T + 1 positions.
  void write_row(Split split, uint64_t row, int64_t T, int64_t* inputs, int64_t* targets) const;
  uint64_t rows(Split s) const { return part(s).rows; }
  // The tokens of row `row` that are its example, the rest being left padding ({split}.lengths.bin);
  // has_lengths() is false for a dataset tokenized before that file was written.
  bool has_lengths() const { return !train_.lengths.empty(); }
  uint64_t example_length(Split s, uint64_t row) const { return part(s).lengths[row]; }
  uint32_t pad_id() const { return pad_id_; }
  uint64_t row_length() const { return train_.length; }  // L, the same in both splits
  const TokenFile& tokens(Split s) const { return *part(s).tokens; }  // (rows, L)

 protected:
  // `style` PADDED, CONTRASTIVE (whose rows come in pairs: meta.json's records count pairs) or PROMPTS.
  PaddedDataset(const std::string& dir, const std::string& name, DatasetStyle style);

 private:
  struct Part {
    std::unique_ptr<TokenFile> tokens;
    std::vector<uint8_t> mask;
    std::vector<uint32_t> lengths;  // empty without {split}.lengths.bin
    uint64_t rows = 0, length = 0;
  };
  const Part& part(Split s) const { return s == Split::Train ? train_ : val_; }
  Part train_, val_;
  uint32_t pad_id_ = 0;
};

// Preference pairs: PADDED rows two by two (chosen, rejected), a sample being both.
class ContrastiveDataset : public PaddedDataset {
 public:
  ContrastiveDataset(const std::string& dir, const std::string& name)
      : PaddedDataset(dir, name, DatasetStyle::CONTRASTIVE) {}
  uint64_t num_samples(Split split, int64_t T) const override;
  void sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const override;
  int64_t rows_per_sample() const override { return 2; }
};

// Opens datasets by name under one data directory, once each.
class DataCatalog {
 public:
  // vocab_size > 0: every dataset's token ids are checked against it when it is first opened. pack
  // (data/pack): padded datasets open packed (PackedDataset, packing.hpp).
  explicit DataCatalog(std::string data_dir, int64_t vocab_size = 0, bool pack = false)
      : dir_(std::move(data_dir)), vocab_size_(vocab_size), pack_(pack) {}
  const Dataset& get(const Sampling& s);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int64_t vocab_size_;
  bool pack_;
  std::map<std::string, std::unique_ptr<Dataset>> open_;
};

struct Batch {
  torch::Tensor inputs;   // (B, W) int64, W = rows_per_sample * T (T, or 2T for preference pairs)
  torch::Tensor targets;  // (B, W) int64, -1 where ignored
  torch::Tensor segments;  // (B, W) int64 where a dataset of the batch is packed (Dataset::sample), else undefined

  // `count` rows of `width` positions for sample_into to fill; segments (zeros) where `packed`.
  static Batch blank(int64_t count, int64_t width, bool packed);
  // Writes sample `index` of `ds`'s `split` into row r (and its segments where the batch has them).
  void sample_into(int64_t r, const Dataset& ds, Split split, uint64_t index, int64_t T);
  // `f` of each tensor the batch has (a slice of rows, a copy on the device); `source` is not carried.
  template <class F>
  Batch map(F f) const {
    Batch out;
    out.inputs = f(inputs);
    out.targets = f(targets);
    if (segments.defined()) out.segments = f(segments);
    return out;
  }
  std::vector<int> source;  // index into the stage's samplings, per row
  std::vector<uint64_t> index;  // the sample drawn from that dataset's train split, per row
};

// The rows of `a`, then those of `b` (the same width); segments where either has them (a batch without
// is one sequence a row: zeros).
Batch concat_rows(const Batch& a, const Batch& b);

// Draws rows of one stage's mixture. The datasets of a mixture have the same rows_per_sample (a
// UserError otherwise): preference pairs do not mix with single rows.
class MixtureSampler {
 public:
  MixtureSampler(DataCatalog& catalog, std::vector<Sampling> samplings, int64_t block_size, uint64_t seed,
                 uint64_t stream);
  // Rows [first, first + count) of the stage's row sequence; does not move the cursor.
  Batch rows(uint64_t first, int64_t count) const;
  // The next `count` rows; advances the cursor.
  Batch next(int64_t count);
  // Rows [first, first + count) of the next `total` rows (one rank's share of a global batch);
  // advances the cursor past all `total`.
  Batch next_share(int64_t total, int64_t first, int64_t count);
  uint64_t cursor() const { return cursor_; }
  void set_cursor(uint64_t c) { cursor_ = c; }
  const std::vector<Sampling>& samplings() const { return samplings_; }
  const Dataset& dataset(size_t i) const { return *datasets_[i]; }
  int64_t rows_per_sample() const { return rows_per_sample_; }

 private:
  std::vector<Sampling> samplings_;
  std::vector<const Dataset*> datasets_;
  std::vector<double> cumulative_;
  int64_t T_, rows_per_sample_ = 1;
  bool packed_ = false;  // a dataset of the mixture is packed: the batches carry segments
  uint64_t seed_, stream_, cursor_ = 0;
};

// `total` split over `weights` by the largest-remainder method: the parts sum to `total`.
std::vector<int64_t> largest_remainder(const std::vector<double>& weights, int64_t total);

// The fixed validation rows of one dataset: samples 0..rows-1 of its val split (wrapping); a
// contrastive dataset's are pairs, (count, 2T).
Batch validation_rows(const Dataset& ds, int64_t block_size, uint64_t first, int64_t count);

// The baseline a language model must beat: cross-entropy (nats per token) of the validation split
// under the training split's unigram distribution (add-one smoothed over `vocab` ids). PMD only.
double unigram_val_loss(const PmdDataset& ds, int64_t vocab);

// splitmix64: the counter-based hash behind sampling.
uint64_t mix64(uint64_t x);

}  // namespace lt
