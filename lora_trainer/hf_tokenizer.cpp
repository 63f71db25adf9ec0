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
#include "lora_trainer/hf_tokenizer.hpp"

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lora_trainer/byte_level_bpe.hpp"
#include "lora_trainer/util.hpp"

namespace lt {
namespace {

using namespace bpe;  // NOLINT: the shared byte-level BPE parts
using nlohmann::json;

// The regex of the ByteLevel pre-tokenizer with use_regex true (tokenizers' byte_level.rs).
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Tried in this order when tokenizer_config.json names no eos_token.
const std::vector<std::string> kEotCandidates = {"<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>"};

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& dir);

  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;
  uint32_t vocab_size() const override { return static_cast<uint32_t>(id_bytes_.size()); }
  uint32_t eot_id() const override { return eot_id_; }
  std::string name() const override { return name_; }

 private:
  struct AddedToken {
    std::string content;
    uint32_t id;
    bool normalized;  // matched in the normalized text, by its normalized content
  };
  // The added tokens matched in one pass: longest content first, and their first bytes.
  struct AddedSet {
    std::vector<AddedToken> tokens;
    std::string first_bytes;
    void add(AddedToken t);
  };

  UserError unsupported(const std::string& what) const;
  void read_model(const json& model);
  void read_added_tokens(const json& added);
  void read_normalizer(const json& n);
  void split_added_tokens();
  void read_pre_tokenizer(const json& p, bool* byte_level_seen);
  void read_decoder(const json& d);
  void read_eot(const std::string& dir);
  // text after the normalizers: text itself, or a view of storage holding the normalized text.
  std::string_view normalize(std::string_view text, std::string& storage) const;
  // The next token of `set` at or after pos: its index in set.tokens and where it starts; false if none.
  static bool next_added(const AddedSet& set, std::string_view text, size_t pos, size_t* index,
                         size_t* begin);
  void encode_normalized(std::string_view piece, WordIds& cache, std::vector<uint32_t>& out) const;
  void split_and_encode(std::string_view piece, size_t level, WordIds& cache, std::vector<uint32_t>& out) const;
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
  uint32_t eot_id_ = 0;
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
  if (!fs::is_regular_file(path_)) {
    std::string msg = "hf tokenizer: " + dir + " has no tokenizer.json";
    if (fs::exists(fs::path(dir) / "tokenizer.model"))
      msg += " (its tokenizer.model is a SentencePiece model, which is not supported)";
    throw UserError(msg + "; save the tokenizer with transformers' save_pretrained to get one");
  }
  const json j = read_json_file(path_);
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw UserError(path_ + " is not a Hugging Face tokenizer.json (no \"model\" object)");
  // Added tokens first: vocab entries with their ids are not byte-level strings.
  if (j.contains("added_tokens")) read_added_tokens(j["added_tokens"]);
  read_model(j["model"]);
  read_normalizer(j.value("normalizer", json()));
  split_added_tokens();
  bool byte_level = false;
  read_pre_tokenizer(j.value("pre_tokenizer", json()), &byte_level);
  if (!byte_level) throw unsupported("a pre_tokenizer without ByteLevel (not a byte-level BPE)");
  read_decoder(j.value("decoder", json()));
  read_eot(dir);
}

void HfTokenizer::read_added_tokens(const json& added) {
  if (!added.is_array()) throw UserError(path_ + ": \"added_tokens\" is not an array");
  for (const auto& t : added) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_unsigned() || !t.contains("content") ||
        !t["content"].is_string())
      throw UserError(path_ + ": an added token lacks an unsigned \"id\" or a string \"content\"");
    const std::string content = t["content"];
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      if (t.value(flag, false)) throw unsupported("added token \"" + content + "\" with " + flag + " true");
    if (content.empty()) continue;
    // The library's files always have "normalized"; its AddedToken::from(content, special) gives !special.
    const bool normalized = t.value("normalized", !t.value("special", false));
    added_.push_back({content, t["id"].get<uint32_t>(), normalized});
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

  std::vector<bool> is_added;
  size_t size = 0;
  for (const auto& t : added_) size = std::max<size_t>(size, size_t{t.id} + 1);
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_unsigned()) throw UserError(path_ + ": the id of vocab token \"" + token + "\" is not an unsigned number");
    size = std::max<size_t>(size, id.get<size_t>() + 1);
  }
  id_bytes_.assign(size, std::string());
  id_known_.assign(size, false);
  is_added.assign(size, false);
  for (const auto& t : added_) {
    id_bytes_[t.id] = t.content;
    id_known_[t.id] = is_added[t.id] = true;
  }
  const std::vector<uint32_t> byte_to_cp = bytes_to_unicode();
  std::unordered_map<uint32_t, unsigned char> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);
  for (const auto& [token, value] : model["vocab"].items()) {
    const auto id = value.get<uint32_t>();
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
    try {
      splits_.push_back(regex_compile(p["pattern"]["Regex"].get<std::string>(), "the Split pattern"));
    } catch (const std::runtime_error& e) {
      throw UserError(path_ + ": " + e.what());
    }
  } else if (type == "ByteLevel") {
    if (*byte_level_seen) throw unsupported("two ByteLevel pre-tokenizers");
    if (p.value("add_prefix_space", false)) throw unsupported("ByteLevel with add_prefix_space true");
    if (p.value("use_regex", true)) splits_.push_back(regex_compile(kByteLevelPattern, "the ByteLevel pattern"));
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
  if (std::filesystem::is_regular_file(config)) {
    const json c = read_json_file(config);
    json eos = c.is_object() ? c.value("eos_token", json()) : json();
    if (eos.is_object()) eos = eos.value("content", json());
    if (eos.is_string()) {
      if (!id_of(eos.get<std::string>(), &eot_id_))
        throw UserError(config + ": eos_token \"" + eos.get<std::string>() + "\" is not a token of " + path_);
      return;
    }
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
  while (search < piece.size() && regex_next(splits_[level], md, piece, search, &begin, &end)) {
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
