// See byte_level_bpe.hpp.
#include "lora_trainer/byte_level_bpe.hpp"

#include <cstring>
#include <functional>
#include <queue>
#include <limits>
#include <stdexcept>

namespace lt::bpe {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there are not one. The
// second-byte bounds exclude overlongs, surrogates and code points above U+10FFFF (WHATWG / Unicode).
size_t utf8_sequence_length(std::string_view s, size_t i, size_t* valid_prefix) {
  const auto b = static_cast<unsigned char>(s[i]);
  *valid_prefix = 1;
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < lo || c > hi) return 0;
    lo = 0x80;
    hi = 0xBF;
    *valid_prefix = k + 1;
  }
  return need + 1;
}

// Replaces each maximal invalid subsequence by U+FFFD, as Node's (WHATWG) UTF-8 decoder does: a lead
// byte and the continuation bytes that were acceptable so far become one U+FFFD; the byte that broke
// the sequence is examined again as a possible lead byte.
std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 16);
  size_t i = 0;
  while (i < s.size()) {
    size_t prefix;
    size_t len = utf8_sequence_length(s, i, &prefix);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      append_utf8(out, 0xFFFD);
      i += prefix;
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0, prefix;
  while (i < s.size()) {
    // ASCII runs dominate real text; skip them 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    size_t len = utf8_sequence_length(s, i, &prefix);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string_view valid_utf8(std::string_view s, std::string& storage) {
  if (is_valid_utf8(s)) return s;
  storage = sanitize_utf8(s);
  return storage;
}

void WordCache::remember(WordIds& words, std::string word, std::vector<uint32_t> ids) {
  if (words.size() >= kMaxWords) words.clear();
  words.emplace(std::move(word), std::move(ids));
}

// GPT-2's reversible byte -> code point table: printable Latin-1 bytes map to themselves, the other
// 68 bytes to U+0100.. in byte order, so every byte string is a printable token string.
std::vector<uint32_t> bytes_to_unicode() {
  std::vector<uint32_t> table(256, 0);
  std::vector<bool> printable(256, false);
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = printable[b] ? static_cast<uint32_t>(b) : next++;
  return table;
}

bool token_to_bytes(std::string_view token, const std::unordered_map<uint32_t, unsigned char>& cp_to_byte,
                    std::string* bytes) {
  bytes->clear();
  for (size_t i = 0; i < token.size();) {
    size_t prefix, len = utf8_sequence_length(token, i, &prefix);
    if (len == 0) return false;
    uint32_t cp = static_cast<unsigned char>(token[i]) & (0xFF >> (len == 1 ? 1 : len + 1));
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(token[i + k]) & 0x3F);
    auto it = cp_to_byte.find(cp);
    if (it == cp_to_byte.end()) return false;
    bytes->push_back(static_cast<char>(it->second));
    i += len;
  }
  return true;
}

Regex regex_compile(const std::string& pattern, const std::string& what) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  Regex re(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                         &error, &offset, nullptr));
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(error, msg, sizeof msg);
    throw std::runtime_error(what + " does not compile at offset " + std::to_string(offset) + ": " +
                             reinterpret_cast<char*>(msg));
  }
  // JIT is an optimisation only: without it (a PCRE2 built without JIT) the interpreter gives the
  // same matches.
  pcre2_jit_compile(re.get(), PCRE2_JIT_COMPLETE);
  return re;
}

bool regex_next(const Regex& re, MatchData& md, std::string_view text, size_t pos, size_t* begin, size_t* end) {
  if (!md) {
    md.reset(pcre2_match_data_create_from_pattern(re.get(), nullptr));
    if (!md) throw std::bad_alloc();
  }
  // The text is valid UTF-8 by now; without NO_UTF_CHECK PCRE2 would re-check the whole rest of
  // the subject on every call, which is quadratic.
  int rc = pcre2_match(re.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos, PCRE2_NO_UTF_CHECK,
                       md.get(), nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error(std::string("pre-tokenisation failed: ") + reinterpret_cast<char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
  *begin = ov[0];
  *end = ov[1];
  return true;
}

namespace {

// The library's algorithm (tokenizers' bpe/word.rs): a queue of candidate merges ordered by rank, then
// by the position of the left symbol; symbols keep their first byte's position, so "leftmost" is the
// smallest position. A candidate whose symbols have changed since it was queued is skipped. O(n log n)
// in the word's length, where merging one pair per scan of the word would be quadratic.
void bpe_merge_queued(std::vector<uint32_t>& sym, const MergeTable& merges) {
  const size_t n = sym.size();
  struct Candidate {
    uint32_t rank;
    size_t pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<size_t> prev(n), next(n);  // neighbours in the current word; n = none
  std::vector<bool> gone(n, false);
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  for (size_t i = 0; i < n; ++i) {
    prev[i] = i == 0 ? n : i - 1;
    next[i] = i + 1;
    if (i + 1 < n) {
      auto it = merges.find(pair_key(sym[i], sym[i + 1]));
      if (it != merges.end()) queue.push({it->second.rank, i});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (gone[top.pos] || next[top.pos] >= n) continue;
    const size_t right = next[top.pos];
    auto it = merges.find(pair_key(sym[top.pos], sym[right]));
    if (it == merges.end() || it->second.rank != top.rank) continue;  // stale
    sym[top.pos] = it->second.result;
    gone[right] = true;
    next[top.pos] = next[right];
    if (next[right] < n) prev[next[right]] = top.pos;
    if (prev[top.pos] < n) {
      auto p = merges.find(pair_key(sym[prev[top.pos]], sym[top.pos]));
      if (p != merges.end()) queue.push({p->second.rank, prev[top.pos]});
    }
    if (next[top.pos] < n) {
      auto q = merges.find(pair_key(sym[top.pos], sym[next[top.pos]]));
      if (q != merges.end()) queue.push({q->second.rank, top.pos});
    }
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    if (!gone[i]) sym[w++] = sym[i];
  sym.resize(w);
}

}  // namespace

void bpe_merge(std::vector<uint32_t>& sym, const MergeTable& merges, MergeOrder order) {
  if (order == MergeOrder::kHuggingFace) return bpe_merge_queued(sym, merges);
  // Encoder.js: a scan finds the best pair, a second merges all its occurrences.
  constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
  while (sym.size() > 1) {
    uint32_t best_rank = kNoRank, left = 0, right = 0, merged = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = merges.find(pair_key(sym[i], sym[i + 1]));
      if (it != merges.end() && it->second.rank <= best_rank) {
        best_rank = it->second.rank;
        left = sym[i];
        right = sym[i + 1];
        merged = it->second.result;
      }
    }
    if (best_rank == kNoRank) break;
    size_t w = 0;
    for (size_t i = 0; i < sym.size();) {
      if (i + 1 < sym.size() && sym[i] == left && sym[i + 1] == right) {
        sym[w++] = merged;
        i += 2;
      } else {
        sym[w++] = sym[i++];
      }
    }
    sym.resize(w);
  }
}

}  // namespace lt::bpe
