#include "lora_trainer/data.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "lora_trainer/util.hpp"

namespace fs = std::filesystem;

namespace lt {

std::string style_name(DatasetStyle s) { return s == DatasetStyle::PMD ? "pmd" : "padded"; }

std::vector<Sampling> parse_samplings(const nlohmann::json& v) {
  std::vector<Sampling> out;
  for (const auto& s : v) {
    Sampling x;
    x.name = s.at("name").get<std::string>();
    x.rate = s.at("rate").get<double>();
    x.style = s.value("style", std::string("pmd")) == "padded" ? DatasetStyle::PADDED : DatasetStyle::PMD;
    out.push_back(x);
  }
  return out;
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    throw UserError("cannot open token file " + path + ": " + std::strerror(errno) +
                    " (tokenize the dataset first: `lora_trainer tokenize`, or `bash datasets/prepare.sh`)");
  struct stat st {};
  ::fstat(fd, &st);
  bytes_ = static_cast<size_t>(st.st_size);
  if (bytes_ % 4 != 0) {
    ::close(fd);
    throw UserError(path + " is " + std::to_string(bytes_) +
                    " bytes, not a multiple of 4: not a uint32 token file (re-run the tokenize step)");
  }
  n_ = bytes_ / 4;
  if (bytes_ > 0) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw UserError("cannot map " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<const uint32_t*>(p);
  }
  ::close(fd);
}

TokenFile::~TokenFile() {
  if (data_) ::munmap(const_cast<uint32_t*>(data_), bytes_);
}

static nlohmann::json read_meta(const std::string& dir, const std::string& name) {
  fs::path meta = fs::path(dir) / name / "meta.json";
  if (!fs::exists(meta)) {
    std::string hint = fs::exists(fs::path(dir)) ? "" : " (data/dir \"" + dir + "\" does not exist)";
    throw UserError("dataset \"" + name + "\": " + meta.string() + " not found" + hint +
                    ". Tokenize it with `lora_trainer tokenize --name " + name + " --data-dir " + dir +
                    " INPUT...`, or fix the dataset name in the config");
  }
  try {
    return nlohmann::json::parse(read_file(meta.string()));
  } catch (const nlohmann::json::parse_error& e) {
    throw UserError(meta.string() + ": not valid JSON (" + e.what() + "); re-run the tokenize step");
  }
}

PmdDataset::PmdDataset(const std::string& dir, const std::string& name) {
  name_ = name;
  meta_ = read_meta(dir, name);
  if (meta_.value("style", std::string("pmd")) != "pmd")
    throw UserError("dataset \"" + name + "\" is of style " + meta_.value("style", std::string("?")) +
                    ", but training/dataset samples it as \"pmd\"; set \"style\" in the sampling");
  train_ = std::make_unique<TokenFile>((fs::path(dir) / name / "train.bin").string());
  val_ = std::make_unique<TokenFile>((fs::path(dir) / name / "val.bin").string());
}

uint64_t PmdDataset::num_samples(Split split, int64_t T) const {
  uint64_t n = file(split).size();
  return n >= static_cast<uint64_t>(T) + 1 ? (n - 1) / static_cast<uint64_t>(T) : 0;
}

void PmdDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets) const {
  const TokenFile& f = file(split);
  uint64_t n = num_samples(split, T);
  if (n == 0)
    throw UserError(f.path() + " holds " + std::to_string(f.size()) + " tokens, fewer than block_size + 1 = " +
                    std::to_string(T + 1) + "; use more text or a smaller architecture/block_size");
  const uint32_t* w = f.data() + (index % n) * static_cast<uint64_t>(T);
  for (int64_t t = 0; t < T; ++t) {
    inputs[t] = w[t];
    targets[t] = w[t + 1];
  }
}

PaddedDataset::PaddedDataset(const std::string& dir, const std::string& name) {
  name_ = name;
  meta_ = read_meta(dir, name);
  if (meta_.value("style", std::string("pmd")) != "padded")
    throw UserError("dataset \"" + name + "\" is of style " + meta_.value("style", std::string("pmd")) +
                    ", but the config samples it as \"padded\"; fix \"style\" in the sampling");
  pad_id_ = meta_.value("pad_id", 0u);
  fs::path base = fs::path(dir) / name;
  nlohmann::json shape;
  try {
    shape = nlohmann::json::parse(read_file((base / "shape.json").string()));
  } catch (const nlohmann::json::exception& e) {
    throw UserError((base / "shape.json").string() + ": " + e.what() + "; re-run the tokenize step");
  }
  for (auto [split, part] : {std::pair<const char*, Part*>{"train", &train_}, {"val", &val_}}) {
    auto dims = shape.value(split, std::vector<uint64_t>());
    if (dims.size() != 2 || dims[0] == 0 || dims[1] == 0)
      throw UserError((base / "shape.json").string() + ": \"" + split + "\" must be [rows, length] with both > 0");
    part->rows = dims[0];
    part->length = dims[1];
    part->tokens = std::make_unique<TokenFile>((base / (std::string(split) + ".tokens.bin")).string());
    if (part->tokens->size() != part->rows * part->length)
      throw UserError(part->tokens->path() + " holds " + std::to_string(part->tokens->size()) + " tokens, shape.json says " +
                      std::to_string(part->rows) + " x " + std::to_string(part->length) + "; re-run the tokenize step");
    std::string mask = read_file((base / (std::string(split) + ".mask.bin")).string());
    if (mask.size() != part->rows * part->length)
      throw UserError((base / (std::string(split) + ".mask.bin")).string() + " has " + std::to_string(mask.size()) +
                      " entries, expected rows x length; re-run the tokenize step");
    part->mask.assign(mask.begin(), mask.end());
  }
}

PaddedDataset::~PaddedDataset() = default;

uint64_t PaddedDataset::num_samples(Split split, int64_t) const { return part(split).rows; }

void PaddedDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets) const {
  const Part& p = part(split);
  const uint64_t row = index % p.rows, L = p.length, W = static_cast<uint64_t>(T) + 1;
  const uint32_t* tok = p.tokens->data() + row * L;
  const uint8_t* mask = p.mask.data() + row * L;
  // Window position w in [0, W) maps to row position w - (W - L) when W > L (extra left padding),
  // else to w + (L - W) (the row's last W positions).
  auto at = [&](uint64_t w, bool* counts) -> int64_t {
    if (W > L && w < W - L) {
      *counts = false;
      return pad_id_;
    }
    uint64_t pos = W > L ? w - (W - L) : w + (L - W);
    *counts = mask[pos] != 0;
    return tok[pos];
  };
  for (uint64_t t = 0; t < W - 1; ++t) {
    bool c_in = false, c_out = false;
    inputs[t] = at(t, &c_in);
    int64_t next = at(t + 1, &c_out);
    targets[t] = c_out ? next : -1;
  }
}

const Dataset& DataCatalog::get(const Sampling& s) {
  std::string key = style_name(s.style) + ":" + s.name;
  auto it = open_.find(key);
  if (it != open_.end()) return *it->second;
  std::unique_ptr<Dataset> ds;
  if (s.style == DatasetStyle::PADDED) ds = std::make_unique<PaddedDataset>(dir_, s.name);
  else ds = std::make_unique<PmdDataset>(dir_, s.name);
  const Dataset& ref = *ds;
  open_[key] = std::move(ds);
  return ref;
}

double unigram_val_loss(const PmdDataset& ds, int64_t vocab) {
  std::vector<double> counts(static_cast<size_t>(vocab), 1.0);
  const TokenFile& train = ds.tokens(Split::Train);
  for (uint64_t i = 0; i < train.size(); ++i)
    if (train.data()[i] < counts.size()) counts[train.data()[i]] += 1.0;
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  const TokenFile& val = ds.tokens(Split::Val);
  double nll = 0;
  for (uint64_t i = 0; i < val.size(); ++i) {
    uint32_t t = val.data()[i];
    nll -= std::log((t < counts.size() ? counts[t] : 1.0) / total);
  }
  return val.size() ? nll / static_cast<double>(val.size()) : 0.0;
}

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

MixtureSampler::MixtureSampler(DataCatalog& catalog, std::vector<Sampling> samplings, int64_t block_size,
                               uint64_t seed, uint64_t stream)
    : samplings_(std::move(samplings)), T_(block_size), seed_(seed), stream_(stream) {
  double acc = 0;
  for (const auto& s : samplings_) {
    datasets_.push_back(&catalog.get(s));
    acc += s.rate;
    cumulative_.push_back(acc);
    if (datasets_.back()->num_samples(Split::Train, T_) == 0)
      datasets_.back()->sample(Split::Train, 0, T_, nullptr, nullptr);  // throws the explanatory error
  }
  for (auto& c : cumulative_) c /= acc;
}

Batch MixtureSampler::rows(uint64_t first, int64_t count) const {
  auto inputs = torch::empty({count, T_}, torch::kLong);
  auto targets = torch::empty({count, T_}, torch::kLong);
  Batch b;
  for (int64_t r = 0; r < count; ++r) {
    uint64_t g = first + static_cast<uint64_t>(r);
    uint64_t h1 = mix64(mix64(seed_ ^ mix64(stream_ + 0x51ED)) ^ g);
    uint64_t h2 = mix64(h1 ^ 0xA5A5A5A5DEADBEEFULL);
    double u = static_cast<double>(h1 >> 11) * 0x1.0p-53;
    size_t d = 0;
    while (d + 1 < cumulative_.size() && u >= cumulative_[d]) ++d;
    const Dataset& ds = *datasets_[d];
    ds.sample(Split::Train, h2 % ds.num_samples(Split::Train, T_), T_, inputs[r].data_ptr<int64_t>(),
              targets[r].data_ptr<int64_t>());
    b.source.push_back(static_cast<int>(d));
  }
  b.inputs = inputs;
  b.targets = targets;
  return b;
}

Batch MixtureSampler::next(int64_t count) {
  Batch b = rows(cursor_, count);
  cursor_ += static_cast<uint64_t>(count);
  return b;
}

Batch MixtureSampler::next_share(int64_t total, int64_t first, int64_t count) {
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= total, "next_share: rows [", first, ", ", first + count,
              ") outside a batch of ", total);
  Batch b = rows(cursor_ + static_cast<uint64_t>(first), count);
  cursor_ += static_cast<uint64_t>(total);
  return b;
}

std::vector<int64_t> largest_remainder(const std::vector<double>& weights, int64_t total) {
  double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> parts(weights.size(), 0);
  std::vector<std::pair<double, size_t>> rema;
  int64_t assigned = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    double exact = sum > 0 ? weights[i] / sum * static_cast<double>(total) : 0.0;
    parts[i] = static_cast<int64_t>(std::floor(exact));
    assigned += parts[i];
    rema.emplace_back(exact - std::floor(exact), i);
  }
  // Ties go to the earlier index, so the split is deterministic.
  std::stable_sort(rema.begin(), rema.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t k = 0; assigned < total && k < rema.size(); ++k, ++assigned) parts[rema[k].second] += 1;
  return parts;
}

Batch validation_rows(const Dataset& ds, int64_t T, uint64_t first, int64_t count) {
  Batch b;
  b.inputs = torch::empty({count, T}, torch::kLong);
  b.targets = torch::empty({count, T}, torch::kLong);
  uint64_t n = ds.num_samples(Split::Val, T);
  for (int64_t r = 0; r < count; ++r) {
    uint64_t idx = n ? (first + static_cast<uint64_t>(r)) % n : 0;
    ds.sample(Split::Val, idx, T, b.inputs[r].data_ptr<int64_t>(), b.targets[r].data_ptr<int64_t>());
    b.source.push_back(0);
  }
  return b;
}

}  // namespace lt
