#include "lora_trainer/tokenize.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lora_trainer/hf_tokenizer.hpp"
#include "lora_trainer/tokenizer.hpp"
#include "lora_trainer/util.hpp"

namespace fs = std::filesystem;

namespace lt {

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& gpt2_dir) {
  if (name == "byte") return make_byte_tokenizer();
  if (name == "gpt2") return make_gpt2_tokenizer(gpt2_dir);
  if (name.rfind("hf:", 0) == 0) {
    if (name.size() == 3) throw UserError("tokenizer \"hf:\" names no directory; write hf:DIR (a directory holding tokenizer.json)");
    return make_hf_tokenizer(name.substr(3));
  }
  const std::vector<std::string> known = {"byte", "gpt2", "hf:DIR"};
  std::string msg = "unknown tokenizer \"" + name + "\"; known tokenizers: " + join(known);
  const std::string guess = closest_match(name, known);
  if (!guess.empty()) msg += " (did you mean \"" + guess + "\"?)";
  throw UserError(msg);
}

static bool wanted(const fs::path& p, const std::vector<std::string>& exts) {
  if (exts.empty()) return true;
  std::string s = p.string();
  for (const auto& e : exts)
    if (s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0) return true;
  return false;
}

static std::vector<std::string> collect(const TokenizeOptions& o) {
  std::vector<std::string> files;
  for (const auto& in : o.inputs) {
    if (fs::is_directory(in)) {
      walk_tree(in, [&](const std::string& path, bool is_dir) {
        if (!is_dir && fs::is_regular_file(path) && wanted(path, o.extensions)) files.push_back(fs::canonical(path).string());
        return true;
      });
    } else if (fs::is_regular_file(in)) {
      files.push_back(fs::canonical(in).string());
    } else {
      throw UserError("tokenize: input " + in + " is neither a file nor a directory");
    }
  }
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());  // symlinks are read once
  if (files.empty()) throw UserError("tokenize: no input files found (check the paths and --ext filters)");
  return files;
}

class TokenWriter {
 public:
  explicit TokenWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp-tokenize") {
    out_.open(tmp_, std::ios::binary | std::ios::trunc);
    if (!out_) throw UserError("tokenize: cannot write " + tmp_);
  }
  void write(const std::vector<uint32_t>& ids, size_t from = 0, size_t to = SIZE_MAX) {
    to = std::min(to, ids.size());
    if (from >= to) return;
    // Token files are little-endian uint32, written as the host's memory: hosts are x86-64/aarch64.
    out_.write(reinterpret_cast<const char*>(ids.data() + from), static_cast<std::streamsize>((to - from) * 4));
    count_ += to - from;
  }
  void commit() {
    out_.close();
    if (!out_) throw UserError("tokenize: writing " + tmp_ + " failed (disk full?)");
    fs::rename(tmp_, path_);
  }
  ~TokenWriter() {
    if (out_.is_open()) {
      out_.close();
      std::error_code ec;
      fs::remove(tmp_, ec);
    }
  }
  uint64_t count() const { return count_; }

 private:
  std::string path_, tmp_;
  std::ofstream out_;
  uint64_t count_ = 0;
};

TokenizeResult tokenize_to_pmd(const TokenizeOptions& o) {
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw UserError("tokenize: --val-fraction must be between 0 and 1 (exclusive)");
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  auto files = collect(o);
  fs::create_directories(o.out_dir);
  fs::remove(fs::path(o.out_dir) / "meta.json");  // the dataset is incomplete until meta.json is back
  uint64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += fs::file_size(f);

  TokenizeResult r;
  r.documents = files.size();
  TokenWriter train((fs::path(o.out_dir) / "train.bin").string());
  TokenWriter val((fs::path(o.out_dir) / "val.bin").string());
  Progress progress("tokenize " + fs::path(o.out_dir).filename().string(), total_bytes, "bytes");
  const double f = o.val_fraction;
  for (size_t i = 0; i < files.size(); ++i) {
    std::string text = read_file(files[i]);
    r.bytes += text.size();
    std::vector<uint32_t> ids = tok->encode(text);
    ids.push_back(tok->eot_id());
    if (files.size() == 1) {
      size_t n_val = std::max<size_t>(1, static_cast<size_t>(std::floor(ids.size() * f)));
      train.write(ids, 0, ids.size() - n_val);
      val.write(ids, ids.size() - n_val);
      r.val_documents = 1;
    } else if (std::floor((i + 1) * f) > std::floor(i * f) || (i + 1 == files.size() && r.val_documents == 0)) {
      val.write(ids);
      ++r.val_documents;
    } else {
      train.write(ids);
    }
    progress.update(r.bytes);
  }
  progress.finish();
  r.train_tokens = train.count();
  r.val_tokens = val.count();
  if (r.val_tokens == 0 || r.train_tokens == 0)
    throw UserError("tokenize: the split left " + std::string(r.val_tokens == 0 ? "validation" : "training") +
                    " empty; add documents or change --val-fraction");
  train.commit();
  val.commit();
  nlohmann::json meta = {{"style", "pmd"},
                         {"tokenizer", tok->name()},
                         {"vocab_size", tok->vocab_size()},
                         {"eot_id", tok->eot_id()},
                         {"documents", r.documents},
                         {"val_documents", r.val_documents},
                         {"bytes", r.bytes},
                         {"train_tokens", r.train_tokens},
                         {"val_tokens", r.val_tokens},
                         {"val_fraction", f}};
  write_file_atomic((fs::path(o.out_dir) / "meta.json").string(), meta.dump(2) + "\n");
  return r;
}

namespace {

// A row of a padded dataset before padding: prompt (mask 0) + completion + end-of-text (mask 1).
struct MaskedRow {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> mask;
};

MaskedRow prompt_completion_row(const Tokenizer& tok, const std::string& prompt, const std::string& completion) {
  MaskedRow row;
  row.ids = tok.encode(prompt);
  row.mask.assign(row.ids.size(), 0);
  auto c = tok.encode(completion);
  c.push_back(tok.eot_id());
  row.ids.insert(row.ids.end(), c.begin(), c.end());
  row.mask.insert(row.mask.end(), c.size(), 1);
  return row;
}

// Calls `each(record, where)` for every non-blank line of the JSONL inputs, in file order, after checking
// that it is an object with string fields `fields` (a UserError naming FILE:LINE and the missing field).
void for_each_record(const TokenizeOptions& o, const std::vector<std::string>& fields,
                     const std::function<void(const nlohmann::json&, size_t bytes)>& each) {
  std::vector<std::string> quoted;
  for (const auto& f : fields) quoted.push_back("\"" + f + "\"");
  for (const auto& file : collect(o)) {
    std::istringstream in(read_file(file));
    std::string line;
    for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      auto where = file + ":" + std::to_string(line_no);
      if (j.is_discarded() || !j.is_object()) throw UserError(where + ": not a JSON object");
      for (const auto& f : fields)
        if (!j.contains(f) || !j[f].is_string())
          throw UserError(where + ": a record needs string fields " + join(quoted) + "; \"" + f + "\" is " +
                          (j.contains(f) ? "not a string" : "missing"));
      each(j, line.size());
    }
  }
}

// Writes `rows` (rows_per_record consecutive rows a record) left-padded to a common length as a dataset
// of PADDED's layout and the given style; every k-th record (k = 1 / val_fraction) goes to validation.
TokenizeResult write_padded_rows(const TokenizeOptions& o, const Tokenizer& tok, const std::vector<MaskedRow>& rows,
                                 size_t rows_per_record, const std::string& style, uint64_t bytes) {
  const size_t records = rows.size() / rows_per_record;
  if (records < 2) throw UserError("tokenize: need at least 2 JSONL records (one for validation)");
  if (o.length < 0) throw UserError("tokenize: the row length must be >= 0 (0 = the longest record), got " + std::to_string(o.length));
  uint64_t L = static_cast<uint64_t>(o.length);
  if (L == 0)
    for (const auto& row : rows) L = std::max<uint64_t>(L, row.ids.size());
  fs::create_directories(o.out_dir);
  fs::remove(fs::path(o.out_dir) / "meta.json");
  std::string bufs[2][2];  // [train/val][tokens/mask]
  uint64_t counts[2] = {0, 0};
  TokenizeResult r;
  r.bytes = bytes;
  const double f = o.val_fraction;
  for (size_t i = 0; i < records; ++i) {
    bool val = std::floor((i + 1) * f) > std::floor(i * f) || (i + 1 == records && counts[1] == 0);
    for (size_t k = 0; k < rows_per_record; ++k) {
      const auto& row = rows[i * rows_per_record + k];
      size_t n = row.ids.size(), keep = std::min<size_t>(n, L), pad = L - keep;
      std::vector<uint32_t> ids(pad, tok.eot_id());
      std::vector<uint8_t> mask(pad, 0);
      ids.insert(ids.end(), row.ids.end() - keep, row.ids.end());
      mask.insert(mask.end(), row.mask.end() - keep, row.mask.end());
      bufs[val][0].append(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
      bufs[val][1].append(reinterpret_cast<const char*>(mask.data()), mask.size());
      (val ? r.val_tokens : r.train_tokens) += keep;
    }
    ++counts[val];
  }
  r.documents = records;
  r.val_documents = counts[1];
  const char* split[2] = {"train", "val"};
  for (int s = 0; s < 2; ++s) {
    write_file_atomic((fs::path(o.out_dir) / (std::string(split[s]) + ".tokens.bin")).string(), bufs[s][0]);
    write_file_atomic((fs::path(o.out_dir) / (std::string(split[s]) + ".mask.bin")).string(), bufs[s][1]);
  }
  nlohmann::json shape = {{"train", {counts[0] * rows_per_record, L}}, {"val", {counts[1] * rows_per_record, L}}};
  write_file_atomic((fs::path(o.out_dir) / "shape.json").string(), shape.dump() + "\n");
  nlohmann::json meta = {{"style", style},           {"tokenizer", tok.name()}, {"vocab_size", tok.vocab_size()},
                         {"eot_id", tok.eot_id()},  {"pad_id", tok.eot_id()},  {"records", r.documents},
                         {"val_records", r.val_documents}, {"length", L},        {"train_tokens", r.train_tokens},
                         {"val_tokens", r.val_tokens}, {"val_fraction", f}};
  write_file_atomic((fs::path(o.out_dir) / "meta.json").string(), meta.dump(2) + "\n");
  return r;
}

void check_val_fraction(const TokenizeOptions& o) {
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw UserError("tokenize: --val-fraction must be between 0 and 1 (exclusive)");
}

}  // namespace

TokenizeResult tokenize_jsonl_to_padded(const TokenizeOptions& o) {
  check_val_fraction(o);
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  std::vector<MaskedRow> rows;
  uint64_t bytes = 0;
  for_each_record(o, {"prompt", "completion"}, [&](const nlohmann::json& j, size_t n) {
    rows.push_back(prompt_completion_row(*tok, j["prompt"].get<std::string>(), j["completion"].get<std::string>()));
    bytes += n;
  });
  return write_padded_rows(o, *tok, rows, 1, "padded", bytes);
}

TokenizeResult tokenize_jsonl_to_contrastive(const TokenizeOptions& o) {
  check_val_fraction(o);
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  std::vector<MaskedRow> rows;
  uint64_t bytes = 0;
  for_each_record(o, {"prompt", "chosen", "rejected"}, [&](const nlohmann::json& j, size_t n) {
    const std::string prompt = j["prompt"].get<std::string>();
    rows.push_back(prompt_completion_row(*tok, prompt, j["chosen"].get<std::string>()));
    rows.push_back(prompt_completion_row(*tok, prompt, j["rejected"].get<std::string>()));
    bytes += n;
  });
  return write_padded_rows(o, *tok, rows, 2, "contrastive", bytes);
}

}  // namespace lt
