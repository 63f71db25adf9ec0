#include "lora_trainer/data/packing.hpp"

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>

#include "lora_trainer/core/util.hpp"

namespace lt {

Packing pack_best_fit(const std::vector<uint64_t>& sizes, uint64_t capacity) {
  std::vector<uint64_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return sizes[a] > sizes[b]; });
  std::vector<std::vector<uint64_t>> bins;
  std::set<std::pair<uint64_t, uint64_t>> room;  // (room left, bin): the tightest fit is the first with enough room
  for (uint64_t item : order) {
    const uint64_t size = sizes[item];
    if (size == 0) continue;
    if (size > capacity) throw std::logic_error("pack_best_fit: an item of " + std::to_string(size) + " exceeds the capacity");
    auto it = room.lower_bound({size, 0});
    uint64_t bin = bins.size(), left = capacity;
    if (it != room.end()) {
      std::tie(left, bin) = *it;
      room.erase(it);
    } else {
      bins.emplace_back();
    }
    bins[bin].push_back(item);
    room.insert({left - size, bin});
  }
  Packing p;
  for (auto& bin : bins) {
    std::sort(bin.begin(), bin.end());
    p.index.insert(p.index.end(), bin.begin(), bin.end());
    p.offset.push_back(p.index.size());
  }
  return p;
}

PackedDataset::PackedDataset(std::unique_ptr<PaddedDataset> rows) : rows_(std::move(rows)) {
  name_ = rows_->name();
  meta_ = rows_->meta();
  if (!rows_->has_lengths())
    throw UserError("dataset \"" + name_ + "\" has no train.lengths.bin (it was tokenized before packing existed): data/pack "
                    "needs each row's length. Re-run `lora_trainer tokenize` on its JSONL, or set data/pack=false");
}

uint64_t PackedDataset::positions_of(Split split, uint64_t row, int64_t T) const {
  const uint64_t n = rows_->example_length(split, row);
  return std::min<uint64_t>(n > 0 ? n - 1 : 0, static_cast<uint64_t>(T));
}

const Packing& PackedDataset::packing(Split split, int64_t T) const {
  auto key = std::make_pair(split, T);
  auto it = packings_.find(key);
  if (it != packings_.end()) return it->second;
  std::vector<uint64_t> sizes(rows_->rows(split));
  for (uint64_t r = 0; r < sizes.size(); ++r) sizes[r] = positions_of(split, r, T);
  return packings_.emplace(key, pack_best_fit(sizes, static_cast<uint64_t>(T))).first->second;
}

uint64_t PackedDataset::num_samples(Split split, int64_t T) const { return packing(split, T).rows(); }

void PackedDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t* segments) const {
  const Packing& p = packing(split, T);
  if (p.rows() == 0) require_samples(split, T);
  const uint64_t row = index % p.rows();
  int64_t at = 0, example = 0;
  for (uint64_t k = p.offset[row]; k < p.offset[row + 1]; ++k, ++example) {
    const auto n = static_cast<int64_t>(positions_of(split, p.index[k], T));
    rows_->write_row(split, p.index[k], n, inputs + at, targets + at);  // its last n + 1 tokens: the whole example
    if (segments) std::fill(segments + at, segments + at + n, example);
    at += n;
  }
  std::fill(inputs + at, inputs + T, static_cast<int64_t>(rows_->pad_id()));
  std::fill(targets + at, targets + T, int64_t{-1});
  if (segments) std::fill(segments + at, segments + T, example);  // the tail: a segment of its own
}

}  // namespace lt
