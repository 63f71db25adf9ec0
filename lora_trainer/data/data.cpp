#include "lora_trainer/data/data.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "lora_trainer/core/util.hpp"
#include "lora_trainer/data/packing.hpp"
#include "lora_trainer/data/prompts.hpp"

namespace fs = std::filesystem;

namespace lt {

std::vector<Sampling> parse_samplings(const nlohmann::json& v) {
  std::vector<Sampling> out;
  for (const auto& s : v) {
    Sampling x;
    x.name = s.at("name").get<std::string>();
    x.rate = s.at("rate").get<double>();
    x.style = parse_dataset_style(s.value("style", style_name(DatasetStyle::PMD)), "sampling of dataset \"" + x.name + "\"");
    out.push_back(x);
  }
  return out;
}

// The style dataset `name`'s meta.json records (read_meta checked it); pmd when it records none.
static DatasetStyle meta_style(const nlohmann::json& meta, const std::string& name) {
  return parse_dataset_style(meta.value("style", style_name(DatasetStyle::PMD)), "dataset \"" + name + "\"");
}

Sampling parse_dataset_spec(const std::string& spec) {
  Sampling out{spec, 1.0, DatasetStyle::PMD};
  for (DatasetStyle style : {DatasetStyle::PADDED, DatasetStyle::CONTRASTIVE, DatasetStyle::PROMPTS}) {
    const std::string tail = ":" + style_name(style);
    if (spec.size() > tail.size() && ends_with(spec, tail)) out = {spec.substr(0, spec.size() - tail.size()), 1.0, style};
  }
  const size_t colon = out.name.rfind(':');
  if (colon != std::string::npos)
    throw UserError("dataset \"" + spec + "\": \"" + out.name.substr(colon) + "\" is not a style; write NAME for text, NAME:" +
                    style_name(DatasetStyle::PADDED) + ", NAME:" + style_name(DatasetStyle::CONTRASTIVE) + " or NAME:" +
                    style_name(DatasetStyle::PROMPTS));
  if (const std::string problem = name_problem(out.name); !problem.empty()) throw UserError("dataset " + problem);
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
  nlohmann::json m = read_json_file(meta.string(), "re-run the tokenize step");
  if (!m.is_object()) throw UserError(meta.string() + ": not a JSON object; re-run the tokenize step");
  auto count = [&](const char* key, bool positive) {
    if (!m.contains(key)) return;
    const auto& v = m[key];
    if (!(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0)) || (positive && v.get<int64_t>() == 0))
      throw UserError(meta.string() + ": \"" + key + "\" must be a" + (positive ? " positive" : " non-negative") +
                      " integer, got " + v.dump() + "; re-run the tokenize step");
  };
  count("vocab_size", true);
  for (const char* k : {"eot_id", "pad_id", "train_tokens", "val_tokens", "records", "val_records", "length"}) count(k, false);
  // Token ids are uint32 (the token files' entries): a larger id or vocabulary would be cut when read.
  for (const char* k : {"vocab_size", "eot_id", "pad_id"})
    if (m.contains(k) && m[k].get<uint64_t>() > (std::string(k) == "vocab_size" ? uint64_t{1} << 32 : UINT32_MAX))
      throw UserError(meta.string() + ": \"" + k + "\" is " + m[k].dump() + ", beyond the uint32 token ids of the token "
                      "files; re-run the tokenize step");
  const auto& styles = dataset_style_names();
  if (m.contains("style") &&
      (!m["style"].is_string() || std::find(styles.begin(), styles.end(), m["style"].get<std::string>()) == styles.end()))
    throw UserError(meta.string() + ": \"style\" must be " + dataset_style_choices() + "; re-run the tokenize step");
  return m;
}

// The first id >= vocab in a token file: its position, or npos.
static uint64_t first_out_of_vocabulary(const TokenFile& f, int64_t vocab) {
  const uint32_t* d = f.data();
  const uint64_t n = f.size();
  uint32_t hi = 0;
  for (uint64_t i = 0; i < n; ++i) hi = std::max(hi, d[i]);  // vectorised scan; the position only on failure
  if (n == 0 || hi < static_cast<uint64_t>(vocab)) return UINT64_MAX;
  for (uint64_t i = 0; i < n; ++i)
    if (d[i] >= static_cast<uint64_t>(vocab)) return i;
  return UINT64_MAX;
}

static void check_ids(const std::string& dataset, const nlohmann::json& meta, const TokenFile& f, int64_t vocab) {
  uint64_t at = first_out_of_vocabulary(f, vocab);
  if (at == UINT64_MAX) return;
  std::string made = meta.contains("tokenizer") && meta.contains("vocab_size")
                         ? " meta.json says it was tokenized with \"" + meta["tokenizer"].dump() + "\" (vocabulary " +
                               meta["vocab_size"].dump() + ")."
                         : "";
  throw UserError("dataset \"" + dataset + "\": " + f.path() + " has token id " + std::to_string(f.data()[at]) +
                  " at position " + std::to_string(at) + " (byte offset " + std::to_string(at * 4) +
                  "), outside the model's vocabulary of " + std::to_string(vocab) + " (architecture/vocab_size)." + made +
                  " Tokenize the data with the model's tokenizer, or raise architecture/vocab_size");
}

static void check_meta_vocabulary(const std::string& dataset, const nlohmann::json& meta, int64_t vocab) {
  if (meta.contains("vocab_size") && meta["vocab_size"].get<int64_t>() > vocab)
    throw UserError("dataset \"" + dataset + "\" was tokenized for a vocabulary of " + meta["vocab_size"].dump() +
                    " (meta.json), larger than the model's " + std::to_string(vocab) +
                    " (architecture/vocab_size): raise architecture/vocab_size, or tokenize with the model's tokenizer");
}

PmdDataset::PmdDataset(const std::string& dir, const std::string& name) {
  name_ = name;
  meta_ = read_meta(dir, name);
  const DatasetStyle style = meta_style(meta_, name);
  if (style != DatasetStyle::PMD)
    throw UserError("dataset \"" + name + "\" is of style " + style_name(style) + ", but training/dataset samples it as \"" +
                    style_name(DatasetStyle::PMD) + "\"; set \"style\" in the sampling");
  train_ = std::make_unique<TokenFile>((fs::path(dir) / name / "train.bin").string());
  val_ = std::make_unique<TokenFile>((fs::path(dir) / name / "val.bin").string());
  for (auto [key, f] : {std::pair<const char*, const TokenFile*>{"train_tokens", train_.get()}, {"val_tokens", val_.get()}})
    if (meta_.contains(key) && meta_[key].get<uint64_t>() != f->size())
      throw UserError("dataset \"" + name + "\": " + f->path() + " holds " + std::to_string(f->size()) +
                      " tokens, meta.json says " + meta_[key].dump() + " (" + key +
                      "): the files do not belong together; re-run the tokenize step");
}

void PmdDataset::check_vocabulary(int64_t vocab) const {
  check_meta_vocabulary(name_, meta_, vocab);
  check_ids(name_, meta_, *train_, vocab);
  check_ids(name_, meta_, *val_, vocab);
}

uint64_t PmdDataset::num_samples(Split split, int64_t T) const {
  uint64_t n = file(split).size();
  return n >= static_cast<uint64_t>(T) + 1 ? (n - 1) / static_cast<uint64_t>(T) : 0;
}

void Dataset::require_samples(Split split, int64_t T) const {
  if (num_samples(split, T) == 0)
    throw UserError("dataset \"" + name_ + "\" has no " + (split == Split::Train ? "training" : "validation") +
                    " samples; re-run the tokenize step");
}

void PmdDataset::require_samples(Split split, int64_t T) const {
  const TokenFile& f = file(split);
  if (num_samples(split, T) == 0)
    throw UserError(f.path() + " holds " + std::to_string(f.size()) + " tokens, fewer than block_size + 1 = " +
                    std::to_string(T + 1) + "; use more text or a smaller architecture/block_size");
}

void PmdDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t*) const {
  const TokenFile& f = file(split);
  uint64_t n = num_samples(split, T);
  if (n == 0) require_samples(split, T);
  const uint32_t* w = f.data() + (index % n) * static_cast<uint64_t>(T);
  for (int64_t t = 0; t < T; ++t) {
    inputs[t] = w[t];
    targets[t] = w[t + 1];
  }
}

// {split}.lengths.bin against the rows it describes, as tokenize wrote them: row r's example is its last
// n = lengths[r] tokens (n >= 1: every record has one), the L - n before it padding (pad_id, mask 0);
// the lengths sum to meta.json's {split}_tokens; the two rows of a preference pair share their prompt
// (the mask-0 tokens before the completion; of a row cut to L tokens, a suffix of it). A lying file
// would have data/pack train on fragments of examples, or on padding, without a word.
static void check_lengths(const fs::path& base, const std::string& split, const TokenFile& tokens, const uint8_t* mask,
                          const std::vector<uint32_t>& lengths, uint64_t L, uint32_t pad_id, const nlohmann::json& meta,
                          bool pairs) {
  const std::string file = (base / (split + ".lengths.bin")).string();
  const std::string redo = "; re-run `lora_trainer tokenize` on the dataset's JSONL";
  uint64_t sum = 0;
  for (uint64_t r = 0; r < lengths.size(); ++r) {
    const uint64_t n = lengths[r];
    if (n == 0) throw UserError(file + ": row " + std::to_string(r) + " has length 0, but every example has a token" + redo);
    const uint32_t* tok = tokens.data() + r * L;
    for (uint64_t p = 0; p < L - n; ++p)
      if (tok[p] != pad_id || mask[r * L + p] != 0)
        throw UserError(file + ": row " + std::to_string(r) + " has length " + std::to_string(n) + " (its last " +
                        std::to_string(n) + " of " + std::to_string(L) + " tokens), but position " + std::to_string(p) +
                        " before them is not padding: token " + std::to_string(tok[p]) + " with mask " +
                        std::to_string(mask[r * L + p]) + " in " + split + ".tokens.bin/" + split + ".mask.bin, where " +
                        "padding is pad_id " + std::to_string(pad_id) + " (meta.json) with mask 0. The lengths do not "
                        "describe the rows" + redo);
    sum += n;
  }
  const std::string key = split + "_tokens";
  if (meta.contains(key) && meta[key].get<uint64_t>() != sum)
    throw UserError(file + ": the rows' lengths sum to " + std::to_string(sum) + " tokens, but meta.json says " + key + " " +
                    meta[key].dump() + ": the files do not belong together" + redo);
  if (!pairs) return;
  // The prompt of row r: its example's tokens before the first that counts in the loss.
  auto prompt = [&](uint64_t r) {
    const uint64_t end = (r + 1) * L;
    uint64_t from = end - lengths[r], to = from;
    while (to < end && mask[to] == 0) ++to;
    return std::make_pair(tokens.data() + from, to - from);
  };
  for (uint64_t r = 0; r + 1 < lengths.size(); r += 2) {
    auto [a, na] = prompt(r);
    auto [b, nb] = prompt(r + 1);
    if (na > nb) std::swap(a, b), std::swap(na, nb);
    if (!std::equal(a, a + na, b + (nb - na)))
      throw UserError((base / (split + ".tokens.bin")).string() + ": the rows " + std::to_string(r) + " and " +
                      std::to_string(r + 1) + " (preference pair " + std::to_string(r / 2) + ", lengths from " + split +
                      ".lengths.bin) have different prompts, but a pair is one prompt with a chosen and a rejected "
                      "completion: the rows are out of order or the files do not belong together" + redo);
  }
}

PaddedDataset::PaddedDataset(const std::string& dir, const std::string& name, DatasetStyle style) {
  name_ = name;
  meta_ = read_meta(dir, name);
  const DatasetStyle recorded = meta_style(meta_, name);
  if (recorded != style)
    throw UserError("dataset \"" + name + "\" is of style " + style_name(recorded) + ", but the config samples it as \"" +
                    style_name(style) + "\"; fix \"style\" in the sampling");
  const uint64_t rows_per_record = style == DatasetStyle::CONTRASTIVE ? 2 : 1;
  pad_id_ = meta_.contains("pad_id") ? meta_["pad_id"].get<uint32_t>() : 0u;
  fs::path base = fs::path(dir) / name;
  nlohmann::json shape = read_json_file((base / "shape.json").string(), "re-run the tokenize step");
  for (auto [split, part] : {std::pair<const char*, Part*>{"train", &train_}, {"val", &val_}}) {
    std::vector<uint64_t> dims;
    if (shape.is_object() && shape.contains(split) && shape[split].is_array())
      for (const auto& d : shape[split])
        if (d.is_number_unsigned()) dims.push_back(d.get<uint64_t>());
    if (dims.size() != 2 || shape[split].size() != 2 || dims[0] == 0 || dims[1] == 0)
      throw UserError((base / "shape.json").string() + ": \"" + split + "\" must be [rows, length] with both > 0");
    part->rows = dims[0];
    part->length = dims[1];
    if (part->rows % rows_per_record != 0)
      throw UserError((base / "shape.json").string() + ": \"" + split + "\" has " + std::to_string(part->rows) +
                      " rows, an odd number: a contrastive dataset holds pairs of rows; re-run the tokenize step");
    part->tokens = std::make_unique<TokenFile>((base / (std::string(split) + ".tokens.bin")).string());
    if (part->tokens->size() != part->rows * part->length)
      throw UserError(part->tokens->path() + " holds " + std::to_string(part->tokens->size()) + " tokens, shape.json says " +
                      std::to_string(part->rows) + " x " + std::to_string(part->length) + "; re-run the tokenize step");
    std::string mask = read_file((base / (std::string(split) + ".mask.bin")).string());
    if (mask.size() != part->rows * part->length)
      throw UserError((base / (std::string(split) + ".mask.bin")).string() + " has " + std::to_string(mask.size()) +
                      " entries, expected rows x length; re-run the tokenize step");
    part->mask.assign(mask.begin(), mask.end());
    auto bad = std::find_if(part->mask.begin(), part->mask.end(), [](uint8_t v) { return v > 1; });
    if (bad != part->mask.end())
      throw UserError((base / (std::string(split) + ".mask.bin")).string() + " has the value " + std::to_string(*bad) +
                      " at byte " + std::to_string(bad - part->mask.begin()) +
                      " (row " + std::to_string((bad - part->mask.begin()) / part->length) +
                      "); a mask holds 0 or 1 only: re-run the tokenize step");
    const fs::path lengths = base / (std::string(split) + ".lengths.bin");
    if (fs::exists(lengths)) {
      const std::string bytes = read_file(lengths.string());
      if (bytes.size() != part->rows * 4)
        throw UserError(lengths.string() + " is " + std::to_string(bytes.size()) + " bytes, expected 4 per row (" +
                        std::to_string(part->rows) + " rows); re-run the tokenize step");
      part->lengths.resize(part->rows);
      std::memcpy(part->lengths.data(), bytes.data(), bytes.size());
      for (uint64_t r = 0; r < part->rows; ++r)
        if (part->lengths[r] > part->length)
          throw UserError(lengths.string() + ": row " + std::to_string(r) + " has length " + std::to_string(part->lengths[r]) +
                          ", longer than the rows' " + std::to_string(part->length) + "; re-run the tokenize step");
      check_lengths(base, split, *part->tokens, part->mask.data(), part->lengths, part->length, pad_id_, meta_,
                    style == DatasetStyle::CONTRASTIVE);
    }
  }
  if (train_.lengths.empty() != val_.lengths.empty())
    throw UserError("dataset \"" + name + "\": one of train.lengths.bin and val.lengths.bin is missing; re-run the tokenize step");
  // meta.json and shape.json were written together: they must agree.
  auto mismatch = [&](const std::string& what) {
    throw UserError("dataset \"" + name + "\": meta.json and shape.json disagree (" + what +
                    "): the files do not belong together; re-run the tokenize step");
  };
  if (train_.length != val_.length)
    mismatch("train rows have length " + std::to_string(train_.length) + ", val rows " + std::to_string(val_.length));
  if (meta_.contains("length") && meta_["length"].get<uint64_t>() != train_.length)
    mismatch("meta.json length " + meta_["length"].dump() + ", shape.json " + std::to_string(train_.length));
  const std::string per = rows_per_record == 2 ? " / 2" : "";  // a contrastive record is two rows
  if (meta_.contains("val_records") && meta_["val_records"].get<uint64_t>() != val_.rows / rows_per_record)
    mismatch("meta.json val_records " + meta_["val_records"].dump() + ", shape.json val rows" + per + " " +
             std::to_string(val_.rows / rows_per_record));
  if (meta_.contains("records") && meta_["records"].get<uint64_t>() != (train_.rows + val_.rows) / rows_per_record)
    mismatch("meta.json records " + meta_["records"].dump() + ", shape.json (train + val rows)" + per + " " +
             std::to_string((train_.rows + val_.rows) / rows_per_record));
}

void PaddedDataset::check_vocabulary(int64_t vocab) const {
  check_meta_vocabulary(name_, meta_, vocab);
  if (pad_id_ >= static_cast<uint64_t>(vocab))
    throw UserError("dataset \"" + name_ + "\": pad_id " + std::to_string(pad_id_) + " (meta.json) is outside the model's "
                    "vocabulary of " + std::to_string(vocab) + " (architecture/vocab_size)");
  check_ids(name_, meta_, *train_.tokens, vocab);
  check_ids(name_, meta_, *val_.tokens, vocab);
}

PaddedDataset::~PaddedDataset() = default;

uint64_t PaddedDataset::num_samples(Split split, int64_t) const { return part(split).rows; }

void PaddedDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t*) const {
  write_row(split, index % part(split).rows, T, inputs, targets);
}

void PaddedDataset::write_row(Split split, uint64_t row, int64_t T, int64_t* inputs, int64_t* targets) const {
  const Part& p = part(split);
  const uint64_t L = p.length, W = static_cast<uint64_t>(T) + 1;
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

uint64_t ContrastiveDataset::num_samples(Split split, int64_t) const { return rows(split) / 2; }

void ContrastiveDataset::sample(Split split, uint64_t index, int64_t T, int64_t* inputs, int64_t* targets, int64_t*) const {
  const uint64_t pair = index % (rows(split) / 2);
  write_row(split, 2 * pair, T, inputs, targets);              // chosen
  write_row(split, 2 * pair + 1, T, inputs + T, targets + T);  // rejected
}

const Dataset& DataCatalog::get(const Sampling& s) {
  std::string key = style_name(s.style) + ":" + s.name;
  auto it = open_.find(key);
  if (it != open_.end()) return *it->second;
  std::unique_ptr<Dataset> ds;
  if (s.style == DatasetStyle::PADDED && pack_) ds = std::make_unique<PackedDataset>(std::make_unique<PaddedDataset>(dir_, s.name));
  else if (s.style == DatasetStyle::PADDED) ds = std::make_unique<PaddedDataset>(dir_, s.name);
  else if (s.style == DatasetStyle::CONTRASTIVE) ds = std::make_unique<ContrastiveDataset>(dir_, s.name);
  else if (s.style == DatasetStyle::PROMPTS) ds = std::make_unique<PromptsDataset>(dir_, s.name);
  else ds = std::make_unique<PmdDataset>(dir_, s.name);
  if (vocab_size_ > 0) ds->check_vocabulary(vocab_size_);
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
    datasets_.back()->require_samples(Split::Train, T_);
    rows_per_sample_ = datasets_.front()->rows_per_sample();
    packed_ = packed_ || datasets_.back()->packed();
    if (datasets_.back()->rows_per_sample() != rows_per_sample_)
      throw UserError("the mixture of " + samplings_.front().name + " (" + style_name(samplings_.front().style) + ") and " +
                      s.name + " (" + style_name(s.style) + ") mixes preference pairs with single rows; a stage's "
                      "datasets are either all contrastive or none");
  }
  for (auto& c : cumulative_) c /= acc;
}

Batch Batch::blank(int64_t count, int64_t width, bool packed) {
  Batch b;
  b.inputs = torch::empty({count, width}, torch::kLong);
  b.targets = torch::empty({count, width}, torch::kLong);
  if (packed) b.segments = torch::zeros({count, width}, torch::kLong);
  return b;
}

void Batch::sample_into(int64_t r, const Dataset& ds, Split split, uint64_t index, int64_t T) {
  ds.sample(split, index, T, inputs[r].data_ptr<int64_t>(), targets[r].data_ptr<int64_t>(),
            segments.defined() ? segments[r].data_ptr<int64_t>() : nullptr);
}

Batch MixtureSampler::rows(uint64_t first, int64_t count) const {
  Batch b = Batch::blank(count, rows_per_sample_ * T_, packed_);
  for (int64_t r = 0; r < count; ++r) {
    uint64_t g = first + static_cast<uint64_t>(r);
    uint64_t h1 = mix64(mix64(seed_ ^ mix64(stream_ + 0x51ED)) ^ g);
    uint64_t h2 = mix64(h1 ^ 0xA5A5A5A5DEADBEEFULL);
    double u = static_cast<double>(h1 >> 11) * 0x1.0p-53;
    size_t d = 0;
    while (d + 1 < cumulative_.size() && u >= cumulative_[d]) ++d;
    const Dataset& ds = *datasets_[d];
    b.sample_into(r, ds, Split::Train, h2 % ds.num_samples(Split::Train, T_), T_);
    b.source.push_back(static_cast<int>(d));
    b.index.push_back(h2 % ds.num_samples(Split::Train, T_));
  }
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

Batch concat_rows(const Batch& a, const Batch& b) {
  Batch out;
  out.inputs = torch::cat({a.inputs, b.inputs});
  out.targets = torch::cat({a.targets, b.targets});
  if (a.segments.defined() || b.segments.defined()) {
    auto segments = [](const Batch& x) { return x.segments.defined() ? x.segments : torch::zeros_like(x.inputs); };
    out.segments = torch::cat({segments(a), segments(b)});
  }
  out.source = a.source;
  out.source.insert(out.source.end(), b.source.begin(), b.source.end());
  out.index = a.index;
  out.index.insert(out.index.end(), b.index.begin(), b.index.end());
  return out;
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
  Batch b = Batch::blank(count, ds.rows_per_sample() * T, ds.packed());
  uint64_t n = ds.num_samples(Split::Val, T);
  for (int64_t r = 0; r < count; ++r) {
    uint64_t idx = n ? (first + static_cast<uint64_t>(r)) % n : 0;
    b.sample_into(r, ds, Split::Val, idx, T);
    b.source.push_back(0);
  }
  return b;
}

}  // namespace lt
