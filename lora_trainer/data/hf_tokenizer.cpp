// Hugging Face tokenizer.json for byte-level BPE (see hf_tokenizer.hpp). The pieces are the gpt2
// tokenizer's (byte_level_bpe.hpp); what differs from GPT-2's own files is read from the JSON.
//
// The library runs its patterns with Oniguruma; lora_trainer with PCRE2 (UTF + UCP). For the GPT-2,
// Llama 3 and Qwen2 patterns they agree except on code points assigned after PCRE2's Unicode version
// (PCRE2 10.42: Unicode 14), which the tests do not cover.
//
// Normalizers (NFC, NFD, NFKC, NFKD, and Sequences of them) are utf8proc's (Debian's libutf8proc), as
// the library applies them (tokenizers' AddedVocabulary::extract_and_normalize): the added tokens with
// normalized false are matched in the raw text first; each piece between them is normalized; then the
// added tokens with normalized true are matched in the normalized pieces, by their normalized content.
#include "lora_trainer/data/hf_tokenizer.hpp"

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lora_trainer/data/byte_level_bpe.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

using namespace bpe;  // NOLINT: the shared byte-level BPE parts
using nlohmann::json;

// The regex of the ByteLevel pre-tokenizer with use_regex true (tokenizers' byte_level.rs).
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Token ids (hf_tokenizer.hpp): at most kMaxTokenId, and the highest below kMaxIdSpread x the number of
// tokens + kMaxIdGap, since the id table spans 0..highest.
constexpr uint32_t kMaxTokenId = (uint32_t{1} << 31) - 1;
constexpr uint64_t kMaxIdSpread = 4;
constexpr uint64_t kMaxIdGap = 65536;

// Tried in this order when tokenizer_config.json names no eos_token.
const std::vector<std::string> kEotCandidates = {"<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>"};

// `o[key]` for an object that may lack it (null then), as a reference into the parsed file so that a
// type error inside it names its full key path (json_context).
const json& member(const json& o, const char* key) {
  static const json null;
  if (!o.is_object()) return null;
  auto it = o.find(key);
  return it == o.end() ? null : *it;
}

// A JSON pointer's escaping of one key ("~" -> "~0", "/" -> "~1"), for key paths in messages.
std::string pointer_key(const std::string& key) {
  std::string out;
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

// A value quoted in a message, cut short: a hostile file's strings can be megabytes long.
std::string shown(const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& dir);

  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  uint32_t vocab_size() const override { return static_cast<uint32_t>(id_bytes_.size()); }
  uint32_t eot_id() const override { return eot_id_; }
  std::string name() const override { return name_; }
  BpeVocabulary vocabulary() const override;

 private:
  struct AddedToken {
    std::string content;
    uint32_t id;
    bool normalized;  // matched in the normalized text, by its normalized content
    std::string where;  // its key path in the file, for messages
    bool special = false;
  };
  // The added tokens matched in one pass: longest content first, and their first bytes.
  struct AddedSet {
    std::vector<AddedToken> tokens;
    std::string first_bytes;
    void add(AddedToken t);
  };

  UserError unsupported(const std::string& what) const;
  // A token id at key path `where` of the file: see hf_tokenizer.hpp for what is accepted.
  uint32_t read_id(const json& v, const std::string& where) const;
  void read_model(const json& model);
  void read_added_tokens(const json& added);
  void read_normalizer(const json& n);
  void split_added_tokens();
  void read_pre_tokenizer(const json& p, bool* byte_level_seen);
  void read_decoder(const json& d);
  void read_eot(const std::string& dir);
  // The token the post-processor puts first (a TemplateProcessing whose `single` starts with a
  // SpecialToken), unless tokenizer_config.json's add_bos_token is false: bos_id_.
  void read_bos(const json& post_processor, const std::string& dir);
  // text after the normalizers: text itself, or a view of storage holding the normalized text.
  std::string_view normalize(std::string_view text, std::string& storage) const;
  // The next token of `set` at or after pos: its index in set.tokens and where it starts; false if none.
  static bool next_added(const AddedSet& set, std::string_view text, size_t pos, size_t* index,
                         size_t* begin);
  void encode_normalized(std::string_view piece, WordIds& cache, std::vector<uint32_t>& out) const;
  void split_and_encode(std::string_view piece, size_t level, WordIds& cache, std::vector<uint32_t>& out) const;
  // regex_next with splits_[level]; a pattern that exceeds PCRE2's limits is a UserError naming it.
  bool next_split(size_t level, MatchData& md, std::string_view piece, size_t pos, size_t* begin, size_t* end) const;
  void encode_word(std::string_view word, WordIds& cache, std::vector<uint32_t>& out) const;

  std::string name_, path_;
  std::vector<std::string> id_bytes_;   // id -> its bytes (an added token: its content)
  std::vector<bool> id_known_;          // false for ids in a gap of the numbering
  std::unordered_map<std::string, uint32_t> token_id_;  // vocab token string (byte-level encoded) -> id
  std::unordered_map<std::string, uint32_t> bytes_id_;  // the bytes of a vocab token -> id
  uint32_t byte_id_[256] = {};
  MergeTable merges_;
  bool ignore_merges_ = false;
  std::vector<AddedToken> added_;       // longest content first
  AddedSet raw_added_, normalized_added_;  // added_ by their `normalized` (contents normalized)
  std::vector<utf8proc_option_t> normalizers_;  // utf8proc_map options, applied in order
  std::vector<Regex> splits_;           // Split / ByteLevel patterns, applied in order (Isolated)
  std::vector<std::string> split_patterns_;  // their source, for messages
  uint32_t eot_id_ = 0;
  int64_t bos_id_ = -1;
  std::string normalizer_names_;  // e.g. "NFC", for vocabulary()
  mutable WordCache cache_;  // encode() leases it for the whole call
};

UserError HfTokenizer::unsupported(const std::string& what) const {
  return UserError(path_ + ": " + what +
                   " is not supported; lora_trainer reads byte-level BPE tokenizers (the GPT-2, Llama 3 and "
                   "Qwen2 families); see docs/huggingface.md");
}

HfTokenizer::HfTokenizer(const std::string& dir) : name_("hf:" + dir) {
  namespace fs = std::filesystem;
  path_ = (fs::path(dir) / "tokenizer.json").string();
  if (!fs::is_directory(dir)) throw UserError("hf tokenizer: " + dir + " is not a directory (hf:DIR names a "
                                              "model directory holding tokenizer.json)");
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path_, ec))) {
    std::string msg = "hf tokenizer: " + dir + " has no tokenizer.json";
    if (fs::exists(fs::path(dir) / "tokenizer.model"))
      msg += " (its tokenizer.model is a SentencePiece model, which is not supported)";
    throw UserError(msg + "; save the tokenizer with transformers' save_pretrained to get one");
  }
  require_regular_file(path_, "the tokenizer");
  // Every type error or missing key while reading names this file and the key path.
  json_context(path_, [&] {
    const json j = read_json_file(path_, "save the tokenizer again with transformers' save_pretrained");
    if (!j.is_object() || !member(j, "model").is_object())
      throw UserError(path_ + " is not a Hugging Face tokenizer.json (no \"model\" object)");
    // Added tokens first: vocab entries with their ids are not byte-level strings.
    if (j.contains("added_tokens")) read_added_tokens(j["added_tokens"]);
    read_model(j["model"]);
    read_normalizer(member(j, "normalizer"));
    split_added_tokens();
    bool byte_level = false;
    read_pre_tokenizer(member(j, "pre_tokenizer"), &byte_level);
    if (!byte_level) throw unsupported("a pre_tokenizer without ByteLevel (not a byte-level BPE)");
    read_decoder(member(j, "decoder"));
    read_bos(j.value("post_processor", json()), dir);
  });
  read_eot(dir);
}

void HfTokenizer::read_bos(const json& post_processor, const std::string& dir) {
  const json* template_processing = nullptr;
  if (post_processor.is_object() && post_processor.value("type", std::string()) == "TemplateProcessing") {
    template_processing = &post_processor;
  } else if (post_processor.is_object() && post_processor.value("type", std::string()) == "Sequence" &&
             post_processor.contains("processors") && post_processor["processors"].is_array()) {
    for (const auto& p : post_processor["processors"])
      if (p.is_object() && p.value("type", std::string()) == "TemplateProcessing") template_processing = &p;
  }
  if (template_processing && template_processing->contains("single") && (*template_processing)["single"].is_array() &&
      !(*template_processing)["single"].empty()) {
    const json& first = (*template_processing)["single"][0];
    if (first.is_object() && first.contains("SpecialToken") && first["SpecialToken"].is_object() &&
        first["SpecialToken"].value("id", json()).is_string()) {
      const std::string content = first["SpecialToken"]["id"];
      for (const auto& t : added_)
        if (t.content == content) bos_id_ = t.id;
    }
  }
  const std::string config = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  std::error_code ec;
  if (bos_id_ >= 0 && std::filesystem::is_regular_file(config, ec)) {
    const json c = read_json_file(config);
    if (c.is_object() && c.value("add_bos_token", json()).is_boolean() && !c["add_bos_token"].get<bool>()) bos_id_ = -1;
  }
}

BpeVocabulary HfTokenizer::vocabulary() const {
  BpeVocabulary v;
  v.tokens.resize(id_bytes_.size());
  v.kinds.assign(id_bytes_.size(), BpeVocabulary::Kind::Gap);
  for (size_t id = 0; id < id_bytes_.size(); ++id)
    if (id_known_[id]) {
      v.tokens[id] = bytes_to_token(id_bytes_[id]);
      v.kinds[id] = BpeVocabulary::Kind::Ordinary;
    }
  for (const auto& t : added_) {
    v.tokens[t.id] = t.content;
    v.kinds[t.id] = t.special ? BpeVocabulary::Kind::Special : BpeVocabulary::Kind::Added;
  }
  v.merges = merge_strings(merges_, v.tokens);
  v.patterns = split_patterns_;
  v.gpt2_pattern = split_patterns_.size() == 1 && split_patterns_[0] == kByteLevelPattern;
  v.normalizer = normalizer_names_;
  v.eos = eot_id_;
  v.bos = bos_id_;
  return v;
}

uint32_t HfTokenizer::read_id(const json& v, const std::string& where) const {
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= kMaxTokenId
                                               : v.is_number_integer() && v.get<int64_t>() >= 0 &&
                                                     v.get<int64_t>() <= int64_t{kMaxTokenId};
  if (!in_range)
    throw UserError(path_ + ": " + where + ": " + shown(v) + " is not a token id: ids are integers from 0 to " +
                    std::to_string(kMaxTokenId) + "; fix the file or save the tokenizer again");
  return static_cast<uint32_t>(v.get<uint64_t>());
}

void HfTokenizer::read_added_tokens(const json& added) {
  if (!added.is_array()) throw UserError(path_ + ": \"added_tokens\" is not an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& t = added[i];
    const std::string where = "/added_tokens/" + std::to_string(i);
    if (!t.is_object() || !t.contains("id") || !t.contains("content") || !t["content"].is_string())
      throw UserError(path_ + ": " + where + ": an added token needs an \"id\" and a string \"content\"");
    const uint32_t id = read_id(t["id"], where + "/id");
    const std::string content = t["content"];
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      if (t.value(flag, false)) throw unsupported("added token \"" + content + "\" with " + flag + " true");
    if (content.empty()) continue;
    // The library's files always have "normalized"; its AddedToken::from(content, special) gives !special.
    const bool normalized = t.value("normalized", !t.value("special", false));
    added_.push_back({content, id, normalized, where + "/id", t.value("special", false)});
  }
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
}

void HfTokenizer::AddedSet::add(AddedToken t) {
  if (t.content.empty()) return;
  if (first_bytes.find(t.content[0]) == std::string::npos) first_bytes.push_back(t.content[0]);
  auto at = std::find_if(tokens.begin(), tokens.end(),
                         [&](const AddedToken& o) { return o.content.size() < t.content.size(); });
  tokens.insert(at, std::move(t));
}

// After read_normalizer: a normalized token is looked for by its normalized content, as the library does.
void HfTokenizer::split_added_tokens() {
  for (const auto& t : added_) {
    if (!t.normalized) {
      raw_added_.add(t);
    } else {
      AddedToken n = t;
      std::string storage;
      n.content = std::string(normalize(t.content, storage));
      normalized_added_.add(std::move(n));
    }
  }
}

void HfTokenizer::read_model(const json& model) {
  // Older files may leave "type" out; the library then recognises a BPE by its merges.
  const std::string type = model.value("type", std::string(model.contains("merges") ? "BPE" : ""));
  if (type.empty()) throw unsupported("a model with no \"type\" and no \"merges\" (not a BPE)");
  if (type != "BPE") {
    std::string hint;
    if (type == "Unigram") hint = " (SentencePiece Unigram, e.g. T5, Llama 2 style)";
    if (type == "WordPiece") hint = " (BERT style)";
    throw unsupported("model type \"" + type + "\"" + hint);
  }
  if (model.value("byte_fallback", false))
    throw unsupported("BPE with byte_fallback (SentencePiece-style BPE, e.g. Llama 2 and Mistral)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    throw unsupported("BPE dropout");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      throw unsupported(std::string("BPE ") + key);
  ignore_merges_ = model.value("ignore_merges", false);
  if (!model.contains("vocab") || !model["vocab"].is_object() || !model.contains("merges") ||
      !model["merges"].is_array())
    throw UserError(path_ + ": the BPE model needs a \"vocab\" object and a \"merges\" array");

  // Every id checked (read_id) before anything is sized by them; the table spans 0..highest.
  const json& vocab = model["vocab"];
  std::vector<uint32_t> vocab_ids;
  vocab_ids.reserve(vocab.size());
  uint32_t highest = 0;
  std::string highest_where;
  for (const auto& t : added_)
    if (t.id >= highest) highest = t.id, highest_where = t.where;
  for (const auto& [token, value] : vocab.items()) {
    const std::string where = "/model/vocab/" + pointer_key(token);
    vocab_ids.push_back(read_id(value, where));
    if (vocab_ids.back() >= highest) highest = vocab_ids.back(), highest_where = where;
  }
  const uint64_t tokens = vocab.size() + added_.size();
  if (highest >= kMaxIdSpread * tokens + kMaxIdGap)
    throw UserError(path_ + ": " + highest_where + ": id " + std::to_string(highest) + " is far beyond the " +
                    std::to_string(tokens) + " tokens of the file: the highest id may be " +
                    std::to_string(kMaxIdSpread) + " x the tokens + " + std::to_string(kMaxIdGap) + " (" +
                    std::to_string(kMaxIdSpread * tokens + kMaxIdGap - 1) +
                    " here), as a tokenizer numbers its tokens densely; fix the id");
  const size_t size = size_t{highest} + 1;
  std::vector<bool> is_added(size, false);
  id_bytes_.assign(size, std::string());
  id_known_.assign(size, false);
  for (const auto& t : added_) {
    id_bytes_[t.id] = t.content;
    id_known_[t.id] = is_added[t.id] = true;
  }
  const std::vector<uint32_t> byte_to_cp = bytes_to_unicode();
  std::unordered_map<uint32_t, unsigned char> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);
  size_t k = 0;
  for (const auto& [token, value] : vocab.items()) {
    const uint32_t id = vocab_ids[k++];
    token_id_[token] = id;
    if (is_added[id]) continue;
    std::string bytes;
    if (!token_to_bytes(token, cp_to_byte, &bytes))
      throw unsupported("vocab token \"" + token + "\", which is not byte-level encoded,");
    id_bytes_[id] = bytes;
    id_known_[id] = true;
    bytes_id_[bytes] = id;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_id_.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_id_.end())
      throw UserError(path_ + ": the vocabulary has no token for byte " + std::to_string(b) +
                      " (a byte-level BPE has all 256)");
    byte_id_[b] = it->second;
  }

  const json& merges = model["merges"];
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string left, right;
    if (m.is_string()) {  // "a b", the older format
      const std::string s = m;
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        throw UserError(path_ + ": merge " + std::to_string(rank) + " \"" + s + "\" is not \"left right\"");
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0];
      right = m[1];
    } else {
      throw UserError(path_ + ": merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto l = token_id_.find(left), r = token_id_.find(right), res = token_id_.find(left + right);
    if (l == token_id_.end() || r == token_id_.end() || res == token_id_.end())
      throw UserError(path_ + ": merge " + std::to_string(rank) + " (" + left + " " + right +
                      ") uses or makes a token missing from the vocab");
    merges_[pair_key(l->second, r->second)] = Merge{static_cast<uint32_t>(rank), res->second};
  }
}

void HfTokenizer::read_normalizer(const json& n) {
  if (n.is_null()) return;
  if (!n.is_object()) throw unsupported("a normalizer that is not an object");
  const std::string type = n.value("type", std::string());
  // The Unicode normalization forms with the options utf8proc_NFC() etc. use, less UTF8PROC_NULLTERM
  // (the length is given, so a NUL in the text is a character like any other).
  static const std::vector<std::pair<std::string, int>> kForms = {
      {"NFC", UTF8PROC_STABLE | UTF8PROC_COMPOSE},
      {"NFD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE},
      {"NFKC", UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT},
      {"NFKD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT}};
  for (const auto& [form, options] : kForms)
    if (type == form) {
      normalizers_.push_back(static_cast<utf8proc_option_t>(options));
      normalizer_names_ += (normalizer_names_.empty() ? "" : ",") + form;
      return;
    }
  if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (const auto& sub : n["normalizers"]) read_normalizer(sub);
    return;
  }
  throw unsupported("normalizer \"" + type + "\"");
}

std::string_view HfTokenizer::normalize(std::string_view text, std::string& storage) const {
  if (normalizers_.empty() ||
      std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
    return text;  // every form leaves ASCII as it is
  storage.assign(text);
  for (const utf8proc_option_t options : normalizers_) {
    utf8proc_uint8_t* mapped = nullptr;
    const utf8proc_ssize_t len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(storage.data()),
                                              static_cast<utf8proc_ssize_t>(storage.size()), &mapped, options);
    if (len < 0) {
      std::free(mapped);
      throw std::runtime_error(name_ + ": Unicode normalization failed: " + utf8proc_errmsg(len));
    }
    storage.assign(reinterpret_cast<const char*>(mapped), static_cast<size_t>(len));
    std::free(mapped);
  }
  return storage;
}

void HfTokenizer::read_pre_tokenizer(const json& p, bool* byte_level_seen) {
  if (p.is_null()) return;
  const std::string type = p.value("type", std::string());
  if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
    for (const auto& sub : p["pretokenizers"]) read_pre_tokenizer(sub, byte_level_seen);
  } else if (type == "Split") {
    if (*byte_level_seen) throw unsupported("a Split pre-tokenizer after ByteLevel");
    if (!p.contains("pattern") || !p["pattern"].is_object() || !p["pattern"].contains("Regex") ||
        !p["pattern"]["Regex"].is_string())
      throw unsupported("a Split pre-tokenizer without a Regex pattern");
    if (p.value("behavior", std::string()) != "Isolated")
      throw unsupported("a Split pre-tokenizer with behavior \"" + p.value("behavior", std::string()) + "\"");
    if (p.value("invert", false)) throw unsupported("an inverted Split pre-tokenizer");
    const std::string pattern = p["pattern"]["Regex"];
    try {
      splits_.push_back(regex_compile(pattern, "the Split pattern " + shown(pattern)));
    } catch (const std::runtime_error& e) {
      throw UserError(path_ + ": " + e.what() + "; fix the pattern or save the tokenizer again");
    }
    split_patterns_.push_back(pattern);
  } else if (type == "ByteLevel") {
    if (*byte_level_seen) throw unsupported("two ByteLevel pre-tokenizers");
    if (p.value("add_prefix_space", false)) throw unsupported("ByteLevel with add_prefix_space true");
    if (p.value("use_regex", true)) {
      splits_.push_back(regex_compile(kByteLevelPattern, "the ByteLevel pattern"));
      split_patterns_.push_back(kByteLevelPattern);
    }
    *byte_level_seen = true;
  } else {
    throw unsupported("pre_tokenizer \"" + type + "\"");
  }
}

void HfTokenizer::read_decoder(const json& d) {
  if (d.is_null()) return;
  const std::string type = d.value("type", std::string());
  if (type != "ByteLevel") throw unsupported("decoder \"" + type + "\"");
}

void HfTokenizer::read_eot(const std::string& dir) {
  auto id_of = [&](const std::string& content, uint32_t* id) {
    for (const auto& t : added_)
      if (t.content == content) return *id = t.id, true;
    auto it = token_id_.find(content);
    return it != token_id_.end() ? (*id = it->second, true) : false;
  };
  const std::string config = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(config, ec))) {
    require_regular_file(config, "the tokenizer's configuration");
    const bool named = json_context(config, [&] {
      const json c = read_json_file(config);
      const json* eos = &member(c, "eos_token");
      if (eos->is_object()) eos = &member(*eos, "content");
      if (!eos->is_string()) return false;
      if (!id_of(eos->get<std::string>(), &eot_id_))
        throw UserError(config + ": eos_token " + shown(*eos) + " is not a token of " + path_);
      return true;
    });
    if (named) return;
  }
  for (const auto& c : kEotCandidates)
    if (id_of(c, &eot_id_)) return;
  throw UserError(path_ + ": no end-of-text token: " + config + " names no eos_token and none of " +
                  join(kEotCandidates) + " is a token; add tokenizer_config.json with \"eos_token\"");
}

bool HfTokenizer::next_added(const AddedSet& set, std::string_view text, size_t pos, size_t* index,
                             size_t* begin) {
  if (set.tokens.empty()) return false;
  for (size_t i = text.find_first_of(set.first_bytes, pos); i != std::string_view::npos;
       i = text.find_first_of(set.first_bytes, i + 1)) {
    for (size_t k = 0; k < set.tokens.size(); ++k)  // longest first: the library matches leftmost-longest
      if (text.compare(i, set.tokens[k].content.size(), set.tokens[k].content) == 0) {
        *index = k;
        *begin = i;
        return true;
      }
  }
  return false;
}

// Split with behavior Isolated: the matches and the text between them are pieces, in order.
void HfTokenizer::split_and_encode(std::string_view piece, size_t level, WordIds& cache,
                                   std::vector<uint32_t>& out) const {
  if (piece.empty()) return;
  if (level == splits_.size()) return encode_word(piece, cache, out);
  MatchData md;
  size_t pos = 0, search = 0, begin = 0, end = 0;
  while (search < piece.size() && next_split(level, md, piece, search, &begin, &end)) {
    if (end == begin) {  // an empty match splits nothing; look again one character on
      size_t prefix, len = utf8_sequence_length(piece, begin, &prefix);
      search = begin + std::max<size_t>(len, 1);
      continue;
    }
    split_and_encode(piece.substr(pos, begin - pos), level + 1, cache, out);
    split_and_encode(piece.substr(begin, end - begin), level + 1, cache, out);
    pos = search = end;
  }
  split_and_encode(piece.substr(pos), level + 1, cache, out);
}

bool HfTokenizer::next_split(size_t level, MatchData& md, std::string_view piece, size_t pos, size_t* begin,
                             size_t* end) const {
  try {
    return regex_next(splits_[level], md, piece, pos, begin, end);
  } catch (const RegexLimitError& e) {
    throw UserError(path_ + ": the pre-tokenizer pattern " + shown(split_patterns_[level]) + " could not be run: " +
                    e.what() + "; fix or remove the pattern (GPT-2's, Llama 3's and Qwen2's take one step per "
                    "byte)");
  }
}

void HfTokenizer::encode_word(std::string_view word, WordIds& cache, std::vector<uint32_t>& out) const {
  if (word.size() == 1) return out.push_back(byte_id_[static_cast<unsigned char>(word[0])]);
  std::string key(word);
  if (ignore_merges_) {  // a word that is a token is that token, whatever the merges would make
    auto it = bytes_id_.find(key);
    if (it != bytes_id_.end()) return out.push_back(it->second);
  }
  auto it = cache.find(key);
  if (it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<uint32_t> sym(word.size());
  for (size_t i = 0; i < word.size(); ++i) sym[i] = byte_id_[static_cast<unsigned char>(word[i])];
  bpe_merge(sym, merges_, MergeOrder::kHuggingFace);
  out.insert(out.end(), sym.begin(), sym.end());
  WordCache::remember(cache, std::move(key), std::move(sym));
}

std::vector<uint32_t> HfTokenizer::encode(std::string_view text) const {
  std::string cleaned;
  text = valid_utf8(text, cleaned);
  WordCache::Lease lease(cache_);
  WordIds& cache = lease.words();
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3);
  size_t pos = 0, index = 0, begin = 0;
  while (next_added(raw_added_, text, pos, &index, &begin)) {
    encode_normalized(text.substr(pos, begin - pos), cache, ids);
    ids.push_back(raw_added_.tokens[index].id);
    pos = begin + raw_added_.tokens[index].content.size();
  }
  encode_normalized(text.substr(pos), cache, ids);
  return ids;
}

// A piece of the text between two added tokens that are matched in the raw text.
void HfTokenizer::encode_normalized(std::string_view piece, WordIds& cache,
                                    std::vector<uint32_t>& out) const {
  if (piece.empty()) return;
  std::string storage;
  const std::string_view text = normalize(piece, storage);
  size_t pos = 0, index = 0, begin = 0;
  while (next_added(normalized_added_, text, pos, &index, &begin)) {
    split_and_encode(text.substr(pos, begin - pos), 0, cache, out);
    out.push_back(normalized_added_.tokens[index].id);
    pos = begin + normalized_added_.tokens[index].content.size();
  }
  split_and_encode(text.substr(pos), 0, cache, out);
}

std::string HfTokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    if (id >= id_bytes_.size() || !id_known_[id])
      throw UserError("token id " + std::to_string(id) + " is not in the vocabulary of " + name_ + " (" +
                      std::to_string(id_bytes_.size()) + ")");
    out += id_bytes_[id];
  }
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& dir) { return std::make_unique<HfTokenizer>(dir); }

}  // namespace lt
