#include "lora_trainer/data/tokenize.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>


#include "lora_trainer/data/chat_template.hpp"
#include "lora_trainer/data/hf_tokenizer.hpp"
#include "lora_trainer/data/tokenizer.hpp"
#include "lora_trainer/core/dataset_style.hpp"
#include "lora_trainer/core/memory.hpp"
#include "lora_trainer/core/outputs.hpp"
#include "lora_trainer/core/util.hpp"

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

static bool within(const fs::path& inner, const fs::path& outer) {  // inner == outer or below it
  const auto rel = inner.lexically_relative(outer);
  return !rel.empty() && *rel.begin() != "..";
}

// The files a dataset of `style` was written with before datasets recorded theirs.
static std::vector<std::string> legacy_dataset_files(const std::string& style) {
  if (style == style_name(DatasetStyle::PMD)) return {"meta.json", "train.bin", "val.bin"};
  std::vector<std::string> names = {"meta.json", "shape.json"};
  for (const char* split : {"train", "val"})
    for (const char* part : {".tokens.bin", ".mask.bin", ".lengths.bin"}) names.push_back(split + std::string(part));
  return names;
}

// The dataset directory may be written: new, empty, a dataset of ours (the files it recorded are
// replaced, others kept), or anything else with --force. A dataset written before datasets recorded
// their files is known by its meta.json (a style and tokenizer of ours). Returns the names publish_dir
// may drop from a dataset without a record (an older one's fixed names).
static std::vector<std::string> check_dataset_target(const TokenizeOptions& o) {
  const fs::path out(o.out_dir);
  if (!fs::exists(out)) return {};
  if (!fs::is_directory(out)) throw UserError("tokenize: " + o.out_dir + " exists and is not a directory; give another --name. Nothing was written");
  if (fs::is_empty(out)) return {};
  const std::optional<WriteRecord> record = read_write_record(out.string());
  if (record && record->kind == "dataset") return {};
  if (!record && fs::is_regular_file(out / "meta.json")) {
    nlohmann::json meta;
    try {
      meta = read_json_file((out / "meta.json").string());
    } catch (const UserError&) {
    }
    const std::string style = meta.is_object() && meta.value("style", nlohmann::json()).is_string() ? meta["style"].get<std::string>() : "";
    if (!style.empty() && meta.value("tokenizer", nlohmann::json()).is_string() && meta.contains("vocab_size"))
      return legacy_dataset_files(style);
  }
  if (o.force) return {};
  throw UserError("tokenize: " + o.out_dir + " already holds files and is not a dataset of lora_trainer (no meta.json of ours); "
                  "give another --name, or --force to write the dataset's files into it (other files are kept). "
                  "Nothing was written");
}

// The input files, in sorted order. What this run writes is never read back: an input inside the
// dataset being written is refused; inside an input directory, the dataset directory, the temporaries
// of its writes and the whole data directory (other datasets: token files, not text) are skipped.
static std::vector<std::string> collect(const TokenizeOptions& o) {
  const fs::path out = fs::weakly_canonical(fs::absolute(o.out_dir));
  const fs::path data_dir = out.parent_path();
  const std::string hidden_tmp = "." + out.filename().string() + ".tmp-", hidden_old = "." + out.filename().string() + ".old-";
  auto written_by_us = [&](const fs::path& canonical, bool data_dir_inside_input) {
    if (within(canonical, out)) return true;
    if (canonical.parent_path() == data_dir) {
      const std::string n = canonical.filename().string();
      if (n.rfind(hidden_tmp, 0) == 0 || n.rfind(hidden_old, 0) == 0) return true;
    }
    return data_dir_inside_input && within(canonical, data_dir);
  };
  std::vector<std::string> files;
  for (const auto& in : o.inputs) {
    const fs::path in_c = fs::weakly_canonical(fs::absolute(in));
    if (within(in_c, out))
      throw UserError("tokenize: input " + in + " is inside the dataset being written (" + o.out_dir +
                      "); move the text elsewhere or give another --name. Nothing was written");
    if (fs::is_directory(in)) {
      const bool data_dir_inside = within(data_dir, in_c) && data_dir != in_c;
      bool noted = false;
      walk_tree(in, [&](const std::string& path, bool is_dir) {
        const fs::path c = fs::weakly_canonical(fs::absolute(path));
        if (written_by_us(c, data_dir_inside)) {
          if (!noted)
            std::printf("tokenize: skipping %s inside input %s: it is what tokenize writes, not text to read\n",
                        (data_dir_inside ? data_dir : out).string().c_str(), in.c_str());
          noted = true;
          return false;
        }
        if (!is_dir && fs::is_regular_file(path) && wanted(path, o.extensions)) files.push_back(c.string());
        return true;
      });
    } else if (fs::is_regular_file(in)) {
      files.push_back(in_c.string());
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

static void check_val_fraction(const TokenizeOptions& o) {
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw UserError("tokenize: --val-fraction must be between 0 and 1 (exclusive)");
}

TokenizeResult tokenize_to_pmd(const TokenizeOptions& o) {
  check_val_fraction(o);
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  const auto ours = check_dataset_target(o);
  auto files = collect(o);
  uint64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += fs::file_size(f);

  TokenizeResult r;
  r.documents = files.size();
  publish_dir(o.out_dir, [&](const fs::path& dir) {
    TokenWriter train((dir / "train.bin").string());
    TokenWriter val((dir / "val.bin").string());
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
                      " empty; add documents or change --val-fraction. Nothing was written");
    train.commit();
    val.commit();
    nlohmann::json meta = {{"style", style_name(DatasetStyle::PMD)},
                           {"tokenizer", tok->name()},
                           {"vocab_size", tok->vocab_size()},
                           {"eot_id", tok->eot_id()},
                           {"documents", r.documents},
                           {"val_documents", r.val_documents},
                           {"bytes", r.bytes},
                           {"train_tokens", r.train_tokens},
                           {"val_tokens", r.val_tokens},
                           {"val_fraction", f}};
    write_file_atomic((dir / "meta.json").string(), meta.dump(2) + "\n");
  }, "write dataset " + o.out_dir, ours, {"dataset", "tokenize", o.out_dir});
  return r;
}

namespace {

// A row of a padded dataset before padding: ids and their loss mask (chat_template.hpp).
using MaskedRow = MaskedIds;

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

// Calls `each(line, where)` for every non-blank line of the JSONL inputs, in file order (where = FILE:LINE).
void for_each_line(const TokenizeOptions& o, const std::function<void(const std::string& line, const std::string& where)>& each) {
  for (const auto& file : collect(o)) {
    std::istringstream in(read_file(file));
    std::string line;
    for (int64_t line_no = 1; std::getline(in, line); ++line_no)
      if (line.find_first_not_of(" \t\r") != std::string::npos) each(line, file + ":" + std::to_string(line_no));
  }
}

const char* const kJsonlHint = "each line of a JSONL file is one JSON object";

// Calls `each(record, bytes)` for every record of the JSONL inputs, in file order, after checking that it
// is an object with string fields `fields` (a UserError naming FILE:LINE and the missing field).
void for_each_record(const TokenizeOptions& o, const std::vector<std::string>& fields,
                     const std::function<void(const nlohmann::json&, size_t bytes)>& each) {
  std::vector<std::string> quoted;
  for (const auto& f : fields) quoted.push_back("\"" + f + "\"");
  for_each_line(o, [&](const std::string& line, const std::string& where) {
    auto j = parse_json(line, where, kJsonlHint);
    if (!j.is_object()) throw UserError(where + ": not a JSON object");
    for (const auto& f : fields)
      if (!j.contains(f) || !j[f].is_string())
        throw UserError(where + ": a record needs string fields " + join(quoted) + "; \"" + f + "\" is " +
                        (j.contains(f) ? "not a string" : "missing"));
    each(j, line.size());
  });
}

// Writes `rows` (rows_per_record consecutive rows a record) left-padded to a common length as a dataset
// of PADDED's layout and the given style; every k-th record (k = 1 / val_fraction) goes to validation.
// `ours`: the names an earlier dataset wrote there (check_dataset_target); `chat`: the chat format of a
// dataset of conversations (meta.json's "chat"), else null; `records` (a prompts dataset's): each record's
// JSON line, written to {split}.records.jsonl beside its row.
TokenizeResult write_padded_rows(const TokenizeOptions& o, const Tokenizer& tok, const std::vector<MaskedRow>& rows,
                                 size_t rows_per_record, DatasetStyle style, uint64_t bytes,
                                 const std::vector<std::string>& ours, const nlohmann::json& chat = nullptr,
                                 const std::vector<std::string>* records_json = nullptr) {
  const size_t records = rows.size() / rows_per_record;
  if (records < 2) throw UserError("tokenize: need at least 2 JSONL records (one for validation)");
  if (o.length < 0) throw UserError("tokenize: the row length must be >= 0 (0 = the longest record), got " + std::to_string(o.length));
  uint64_t L = static_cast<uint64_t>(o.length);
  if (L == 0)
    for (const auto& row : rows) L = std::max<uint64_t>(L, row.ids.size());
  // Every row is padded to L: rows x L x 5 bytes (token + mask) must fit in memory.
  uint64_t need = 0;
  const uint64_t memory = static_cast<uint64_t>(machine_memory());
  if (__builtin_mul_overflow(static_cast<uint64_t>(rows.size()), L, &need) || __builtin_mul_overflow(need, uint64_t{5}, &need) ||
      need > memory)
    throw UserError("tokenize: " + std::to_string(rows.size()) + " rows of " + std::to_string(L) + " tokens need more than " +
                    "this machine's " + std::to_string(memory >> 20) + " MiB of memory; lower --length. Nothing was written");
  std::string bufs[2][4];  // [train/val][tokens/mask/lengths/records]
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
      const auto length = static_cast<uint32_t>(keep);
      bufs[val][2].append(reinterpret_cast<const char*>(&length), 4);
      (val ? r.val_tokens : r.train_tokens) += keep;
    }
    if (records_json) bufs[val][3] += (*records_json)[i] + "\n";
    ++counts[val];
  }
  r.documents = records;
  r.val_documents = counts[1];
  publish_dir(o.out_dir, [&](const fs::path& dir) {
    const char* split[2] = {"train", "val"};
    for (int s = 0; s < 2; ++s) {
      write_file_atomic((dir / (std::string(split[s]) + ".tokens.bin")).string(), bufs[s][0]);
      write_file_atomic((dir / (std::string(split[s]) + ".mask.bin")).string(), bufs[s][1]);
      write_file_atomic((dir / (std::string(split[s]) + ".lengths.bin")).string(), bufs[s][2]);
      if (records_json) write_file_atomic((dir / (std::string(split[s]) + ".records.jsonl")).string(), bufs[s][3]);
    }
    nlohmann::json shape = {{"train", {counts[0] * rows_per_record, L}}, {"val", {counts[1] * rows_per_record, L}}};
    write_file_atomic((dir / "shape.json").string(), shape.dump() + "\n");
    nlohmann::json meta = {{"style", style_name(style)},           {"tokenizer", tok.name()}, {"vocab_size", tok.vocab_size()},
                           {"eot_id", tok.eot_id()},  {"pad_id", tok.eot_id()},  {"records", r.documents},
                           {"val_records", r.val_documents}, {"length", L},        {"train_tokens", r.train_tokens},
                           {"val_tokens", r.val_tokens}, {"val_fraction", f}};
    if (!chat.is_null()) meta["chat"] = chat;
    write_file_atomic((dir / "meta.json").string(), meta.dump(2) + "\n");
  }, "write dataset " + o.out_dir, ours, {"dataset", "tokenize", o.out_dir});
  return r;
}

// A JSONL tokenize: the options and the target are checked before any work, then each record with
// string `fields` becomes `rows_per_record` rows (`to_rows`), written as a dataset of `style`.
TokenizeResult tokenize_records(
    const TokenizeOptions& o, const std::vector<std::string>& fields, size_t rows_per_record, DatasetStyle style,
    const std::function<void(const Tokenizer&, const nlohmann::json&, std::vector<MaskedRow>&)>& to_rows) {
  check_val_fraction(o);
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  const auto ours = check_dataset_target(o);
  std::vector<MaskedRow> rows;
  uint64_t bytes = 0;
  for_each_record(o, fields, [&](const nlohmann::json& j, size_t n) {
    to_rows(*tok, j, rows);
    bytes += n;
  });
  return write_padded_rows(o, *tok, rows, rows_per_record, style, bytes, ours);
}

// --chat-var KEY=JSON (or KEY=text, taken as a string) as the template's variables.
nlohmann::ordered_json chat_variables(const std::vector<std::string>& vars) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& v : vars) {
    const size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UserError("--chat-var " + v + ": expected KEY=VALUE (e.g. enable_thinking=false; VALUE is JSON, or else a string)");
    const std::string key = v.substr(0, eq), value = v.substr(eq + 1);
    // JSON is read with parse_ordered_json's bounds (nesting, duplicate keys): a value nested 100,000
    // deep is an error naming the option, not a crash where the value is copied or freed.
    out[key] = nlohmann::ordered_json::accept(value)
                   ? parse_ordered_json(value, "--chat-var " + key, "VALUE is JSON, or else taken as a string")
                   : nlohmann::ordered_json(value);
  }
  return out;
}

}  // namespace

TokenizeResult tokenize_jsonl_to_chat(const TokenizeOptions& o) {
  check_val_fraction(o);
  jinja::Limits limits;
  for (const auto& l : o.chat_limits) limits.set(l);
  if (o.tokenizer.rfind("hf:", 0) != 0 || o.tokenizer.size() == 3)
    throw UserError("tokenize --format chat needs --tokenizer hf:DIR: the model directory whose tokenizer and chat template "
                    "(tokenizer_config.json) turn the conversations into tokens");
  auto tok = make_tokenizer(o.tokenizer);
  ChatTemplate tmpl = ChatTemplate::from_model_dir(o.tokenizer.substr(3), o.chat_template);
  tmpl.set_limits(limits);
  const nlohmann::json chat = chat_format_of(tmpl, o.tokenizer.substr(3), *tok).to_json();  // meta.json's "chat"
  const ChatLoss loss = parse_chat_loss(o.loss_on);
  const nlohmann::ordered_json vars = chat_variables(o.chat_vars);
  const auto ours = o.show ? std::vector<std::string>() : check_dataset_target(o);
  std::vector<MaskedRow> rows;
  std::vector<std::string> nothing_to_learn;
  uint64_t bytes = 0;
  for_each_line(o, [&](const std::string& line, const std::string& where) {
    const auto record = parse_ordered_json(line, where, kJsonlHint);
    const ChatText chat = tmpl.for_training(record, loss, vars, where);
    MaskedRow row = tokenize_chat(*tok, chat, where);
    if (o.length > 0 && static_cast<int64_t>(row.ids.size()) > o.length)
      throw UserError(where + ": the conversation is " + std::to_string(row.ids.size()) + " tokens, longer than a row (--length " +
                      std::to_string(o.length) + "); raise --length or split the conversation. Nothing was written");
    if (std::find(row.mask.begin(), row.mask.end(), 1) == row.mask.end()) nothing_to_learn.push_back(where);
    if (o.show) {
      nlohmann::ordered_json view = {{"where", where}, {"text", chat.text}, {"ids", row.ids}, {"mask", row.mask}};
      std::printf("%s\n", view.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    }
    rows.push_back(std::move(row));
    bytes += line.size();
  });
  if (!nothing_to_learn.empty()) {
    std::vector<std::string> first(nothing_to_learn.begin(), nothing_to_learn.begin() + std::min<size_t>(5, nothing_to_learn.size()));
    throw UserError("tokenize --format chat: " + std::to_string(nothing_to_learn.size()) + " record(s) have no token to learn (no " +
                    (loss == ChatLoss::All ? "text" : "assistant turn, or only empty ones") + "): " + join(first) +
                    (nothing_to_learn.size() > 5 ? ", ..." : "") + ". Fix or drop them. Nothing was written");
  }
  if (o.show) return {};
  return write_padded_rows(o, *tok, rows, 1, DatasetStyle::PADDED, bytes, ours, chat);
}

TokenizeResult tokenize_jsonl_to_prompts(const TokenizeOptions& o) {
  check_val_fraction(o);
  const bool hf = o.tokenizer.rfind("hf:", 0) == 0 && o.tokenizer.size() > 3;
  auto tok = make_tokenizer(o.tokenizer, o.tokenizer_dir.empty() ? default_gpt2_dir() : o.tokenizer_dir);
  std::optional<ChatTemplate> tmpl;  // read when the first conversation needs it
  nlohmann::json chat;
  const nlohmann::ordered_json vars = chat_variables(o.chat_vars);
  jinja::Limits limits;
  for (const auto& l : o.chat_limits) limits.set(l);
  const auto ours = check_dataset_target(o);
  std::vector<MaskedRow> rows;
  std::vector<std::string> records;
  uint64_t bytes = 0;
  for_each_line(o, [&](const std::string& line, const std::string& where) {
    const auto record = parse_ordered_json(line, where, kJsonlHint);
    if (!record.is_object()) throw UserError(where + ": not a JSON object");
    const bool has_prompt = record.contains("prompt"), has_messages = record.contains("messages");
    if (has_prompt == has_messages)
      throw UserError(where + ": a prompt record has \"prompt\" (the text the model continues) or \"messages\" (a "
                      "conversation the chat template ends with its generation prompt), " +
                      (has_prompt ? std::string("not both") : std::string("and it has neither")));
    MaskedRow row;
    if (has_prompt) {
      if (!record["prompt"].is_string()) throw UserError(where + ": \"prompt\" must be a string");
      row.ids = tok->encode(record["prompt"].get<std::string>());
    } else {
      if (!hf)
        throw UserError(where + ": a record of \"messages\" is rendered with the model's chat template: give --tokenizer "
                        "hf:DIR (the model directory whose tokenizer_config.json holds it), or write \"prompt\" as text");
      if (!tmpl) {
        tmpl = ChatTemplate::from_model_dir(o.tokenizer.substr(3), o.chat_template);
        tmpl->set_limits(limits);
        chat = chat_format_of(*tmpl, o.tokenizer.substr(3), *tok).to_json();
      }
      nlohmann::ordered_json variables = vars;
      for (const char* k : {"tools", "documents"})
        if (record.contains(k)) variables[k] = record[k];
      const ChatText text{tmpl->render(chat_messages(record, where), /*add_generation_prompt=*/true, variables).text, {}, 0};
      row = tokenize_chat(*tok, text, where);
    }
    if (row.ids.empty()) throw UserError(where + ": the prompt is empty: there is nothing to continue");
    if (o.length > 0 && static_cast<int64_t>(row.ids.size()) > o.length)
      throw UserError(where + ": the prompt is " + std::to_string(row.ids.size()) + " tokens, longer than a row (--length " +
                      std::to_string(o.length) + "); raise --length or shorten the prompt. Nothing was written");
    row.mask.assign(row.ids.size(), 0);
    rows.push_back(std::move(row));
    records.push_back(record.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
    bytes += line.size();
  });
  return write_padded_rows(o, *tok, rows, 1, DatasetStyle::PROMPTS, bytes, ours, chat, &records);
}

TokenizeResult tokenize_jsonl_to_padded(const TokenizeOptions& o) {
  return tokenize_records(o, {"prompt", "completion"}, 1, DatasetStyle::PADDED,
                          [](const Tokenizer& tok, const nlohmann::json& j, std::vector<MaskedRow>& rows) {
                            rows.push_back(prompt_completion_row(tok, j["prompt"].get<std::string>(),
                                                                 j["completion"].get<std::string>()));
                          });
}

TokenizeResult tokenize_jsonl_to_contrastive(const TokenizeOptions& o) {
  return tokenize_records(o, {"prompt", "chosen", "rejected"}, 2, DatasetStyle::CONTRASTIVE,
                          [](const Tokenizer& tok, const nlohmann::json& j, std::vector<MaskedRow>& rows) {
                            const std::string prompt = j["prompt"].get<std::string>();
                            rows.push_back(prompt_completion_row(tok, prompt, j["chosen"].get<std::string>()));
                            rows.push_back(prompt_completion_row(tok, prompt, j["rejected"].get<std::string>()));
                          });
}

}  // namespace lt
