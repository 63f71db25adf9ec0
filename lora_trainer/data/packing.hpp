// Packing: the short examples of a padded dataset (prompt/completion, chat) several to a row, so that
// a step trains on T tokens of examples instead of mostly padding (data/pack).
//
// An example of n tokens (a row without its left padding, {split}.lengths.bin) takes n - 1 positions:
// inputs its tokens 0..n-2, targets 1..n-1 where its mask counts, exactly the positions it takes alone
// in a row of n tokens. One longer than a row keeps its last T + 1 tokens, as an unpacked row does.
// Examples go into rows of T positions by best-fit decreasing (the longest first, each into the row
// it fills most tightly, a new row when none has room: TRL's "bfd" strategy), a fixed function of the
// example lengths and T, so a packed dataset's samples are as deterministic as a padded one's. A row's
// unused tail holds pad tokens, targets -1.
//
// The model sees where each example lies through the row's segments (Batch::segments): its positions
// restart at 0 at each example and attention never crosses from one example to another
// (SequenceLayout, models/layers.hpp). A packed row's summed loss is therefore the sum of its
// examples' losses taken one by one (tests/data/test_packing.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "lora_trainer/data/data.hpp"

namespace lt {

// Rows of examples: the examples of row r are index[offset[r] .. offset[r + 1]), in ascending order.
struct Packing {
  std::vector<uint64_t> offset{0};
  std::vector<uint64_t> index;
  uint64_t rows() const { return offset.size() - 1; }
};

// Best-fit decreasing of item sizes into bins of `capacity`: the items by size, largest first (ties by
// index), each into the open bin with the least room that holds it. Items of size 0 are left out;
// sizes above capacity are a logic error (callers clip them).
Packing pack_best_fit(const std::vector<uint64_t>& sizes, uint64_t capacity);

// A padded dataset seen packed: a sample is a row of T positions holding one packing row's examples.
class PackedDataset : public Dataset {
 public:
  // A UserError when the dataset has no lengths file (tokenized before packing existed).
  explicit PackedDataset(std::unique_ptr<PaddedDataset> rows);
  uint64_t num_samples(Split split, int64_t T) const override;
  void sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const override;
  bool packed() const override { return true; }
  void check_vocabulary(int64_t vocab_size) const override { rows_->check_vocabulary(vocab_size); }
  // The split's packing into rows of T positions (computed once per split and T).
  const Packing& packing(Split split, int64_t T) const;
  // Positions example `row` takes in a row of T: its length - 1, at most T.
  uint64_t positions_of(Split split, uint64_t row, int64_t T) const;

 private:
  std::unique_ptr<PaddedDataset> rows_;
  mutable std::map<std::pair<Split, int64_t>, Packing> packings_;
};

}  // namespace lt
