#include "lora_trainer/tokenize.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

TokenizeResult tokenize_jsonl_to_padded(const TokenizeOptions& o) {
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw UserError("tokenize: --val-fraction must be between 0 and 1 (exclusive)");
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  struct Row {
    std::vector<uint32_t> ids;
    std::vector<uint8_t> mask;
  };
  std::vector<Row> rows;
  TokenizeResult r;
  for (const auto& file : collect(o)) {
    std::istringstream in(read_file(file));
    std::string line;
    for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      auto where = file + ":" + std::to_string(line_no);
      if (j.is_discarded() || !j.is_object()) throw UserError(where + ": not a JSON object");
      if (!j.contains("prompt") || !j["prompt"].is_string() || !j.contains("completion") || !j["completion"].is_string())
        throw UserError(where + ": a record needs string fields \"prompt\" and \"completion\"");
      Row row;
      auto p = tok->encode(j["prompt"].get<std::string>());
      auto c = tok->encode(j["completion"].get<std::string>());
      c.push_back(tok->eot_id());
      row.ids = p;
      row.ids.insert(row.ids.end(), c.begin(), c.end());
      row.mask.assign(p.size(), 0);
      row.mask.insert(row.mask.end(), c.size(), 1);
      r.bytes += line.size();
      rows.push_back(std::move(row));
    }
  }
  if (rows.size() < 2) throw UserError("tokenize: need at least 2 JSONL records (one for validation)");
  uint64_t L = static_cast<uint64_t>(o.length);
  if (L == 0)
    for (const auto& row : rows) L = std::max<uint64_t>(L, row.ids.size());
  fs::create_directories(o.out_dir);
  fs::remove(fs::path(o.out_dir) / "meta.json");
  std::string bufs[2][2];  // [train/val][tokens/mask]
  uint64_t counts[2] = {0, 0};
  const double f = o.val_fraction;
  for (size_t i = 0; i < rows.size(); ++i) {
    bool val = std::floor((i + 1) * f) > std::floor(i * f) || (i + 1 == rows.size() && counts[1] == 0);
    auto& row = rows[i];
    size_t n = row.ids.size(), keep = std::min<size_t>(n, L), pad = L - keep;
    std::vector<uint32_t> ids(pad, tok->eot_id());
    std::vector<uint8_t> mask(pad, 0);
    ids.insert(ids.end(), row.ids.end() - keep, row.ids.end());
    mask.insert(mask.end(), row.mask.end() - keep, row.mask.end());
    bufs[val][0].append(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
    bufs[val][1].append(reinterpret_cast<const char*>(mask.data()), mask.size());
    ++counts[val];
    (val ? r.val_tokens : r.train_tokens) += keep;
  }
  r.documents = rows.size();
  r.val_documents = counts[1];
  const char* split[2] = {"train", "val"};
  for (int s = 0; s < 2; ++s) {
    write_file_atomic((fs::path(o.out_dir) / (std::string(split[s]) + ".tokens.bin")).string(), bufs[s][0]);
    write_file_atomic((fs::path(o.out_dir) / (std::string(split[s]) + ".mask.bin")).string(), bufs[s][1]);
  }
  nlohmann::json shape = {{"train", {counts[0], L}}, {"val", {counts[1], L}}};
  write_file_atomic((fs::path(o.out_dir) / "shape.json").string(), shape.dump() + "\n");
  nlohmann::json meta = {{"style", "padded"},        {"tokenizer", tok->name()}, {"vocab_size", tok->vocab_size()},
                         {"eot_id", tok->eot_id()},  {"pad_id", tok->eot_id()},  {"records", r.documents},
                         {"val_records", r.val_documents}, {"length", L},        {"train_tokens", r.train_tokens},
                         {"val_tokens", r.val_tokens}, {"val_fraction", f}};
  write_file_atomic((fs::path(o.out_dir) / "meta.json").string(), meta.dump(2) + "\n");
  return r;
}

}  // namespace lt
