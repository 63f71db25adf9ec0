// See byte_level_bpe.hpp.
#include "lora_trainer/data/byte_level_bpe.hpp"

#include <algorithm>
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
  if (word.size() > kMaxWordBytes) return;
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

std::string bytes_to_token(std::string_view bytes) {
  static const std::vector<uint32_t> table = bytes_to_unicode();
  std::string out;
  for (unsigned char b : bytes) append_utf8(out, table[b]);
  return out;
}

std::vector<std::string> merge_strings(const MergeTable& merges, const std::vector<std::string>& token_of) {
  std::vector<std::pair<uint32_t, uint64_t>> by_rank;
  by_rank.reserve(merges.size());
  for (const auto& [key, m] : merges) by_rank.emplace_back(m.rank, key);
  std::sort(by_rank.begin(), by_rank.end());
  std::vector<std::string> out;
  out.reserve(by_rank.size());
  for (const auto& [rank, key] : by_rank) out.push_back(token_of.at(key >> 32) + " " + token_of.at(key & 0xffffffffu));
  return out;
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

namespace {

std::string pcre2_message(int rc) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  return reinterpret_cast<char*>(msg);
}

}  // namespace

bool regex_next(const Regex& re, MatchData& md, std::string_view text, size_t pos, size_t* begin, size_t* end) {
  if (!md.data_) {
    md.data_.reset(pcre2_match_data_create_from_pattern(re.get(), nullptr));
    md.context_.reset(pcre2_match_context_create(nullptr));
    if (!md.data_ || !md.context_) throw std::bad_alloc();
    pcre2_set_heap_limit(md.context_.get(), static_cast<uint32_t>(kMatchHeapBytes / 1024));  // in KiB
  }
  // See the header: limits in proportion to what is left of the text.
  const uint64_t steps = std::min<uint64_t>(std::numeric_limits<uint32_t>::max(),
                                            kMatchStepsBase + uint64_t{kMatchStepsPerByte} * (text.size() - pos));
  pcre2_set_match_limit(md.context_.get(), static_cast<uint32_t>(steps));
  pcre2_set_depth_limit(md.context_.get(), static_cast<uint32_t>(steps));
  auto match = [&](uint32_t options) {
    // The text is valid UTF-8 by now; without NO_UTF_CHECK PCRE2 would re-check the whole rest of
    // the subject on every call, which is quadratic.
    return pcre2_match(re.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                       PCRE2_NO_UTF_CHECK | options, md.data_.get(), md.context_.get());
  };
  int rc = match(0);
  // JIT's stack (32 KiB) is too small for some patterns on long runs (a group repeated a million
  // times): the interpreter gives the same match, on the heap.
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = match(PCRE2_NO_JIT);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT)
    throw RegexLimitError("matching stopped at byte " + std::to_string(pos) + " of a text of " +
                          std::to_string(text.size()) + " bytes: " + pcre2_message(rc) + " (" +
                          std::to_string(steps) + " steps, " + std::to_string(kMatchHeapBytes >> 20) +
                          " MiB); the pattern backtracks catastrophically on this text");
  if (rc < 0) throw std::runtime_error("pre-tokenisation failed: " + pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.data_.get());
  *begin = ov[0];
  *end = ov[1];
  return true;
}

namespace {

// Both merge orders keep the word as a doubly linked list over the byte positions (a symbol keeps its
// first byte's position, so "leftmost" is the smallest position) and a min-queue of candidate merges
// ordered by rank, then position. A candidate whose pair has changed since it was queued is dropped
// when it comes up. Index: uint32_t for words under 4 GiB (half the memory of size_t).
template <class Index>
class MergeQueue {
 public:
  MergeQueue(std::vector<uint32_t>& sym, const MergeTable& merges) : sym_(sym), merges_(merges), n_(sym.size()) {
    prev_.resize(n_);
    next_.resize(n_);
    gone_.assign(n_, false);
    std::vector<Candidate> initial;
    for (size_t i = 0; i < n_; ++i) {
      prev_[i] = static_cast<Index>(i == 0 ? n_ : i - 1);
      next_[i] = static_cast<Index>(i + 1);
      if (i + 1 < n_) push(static_cast<Index>(i), initial);
    }
    queue_ = Queue(std::greater<Candidate>(), std::move(initial));  // heapify: O(n)
  }

  // The library's algorithm (tokenizers' bpe/word.rs): merge the lowest-ranked pair, the leftmost on
  // a tie, one at a time.
  void merge_one_at_a_time() {
    while (!queue_.empty()) {
      const Candidate top = queue_.top();
      queue_.pop();
      if (rank_at(top.pos) == top.rank) merge_at(top.pos);
    }
    finish();
  }

  // Encoder.js: in each round, of the pairs with the lowest rank the one found last in the word is
  // merged wherever it occurs, left to right, in the word as it was when the round began. Pairs that
  // only the round's own merges form are looked at in later rounds (none can be the round's pair:
  // a merged symbol's string is longer than either part).
  void merge_by_rounds() {
    std::vector<Index> round;
    while (!queue_.empty()) {
      const uint32_t rank = queue_.top().rank;
      round.clear();
      while (!queue_.empty() && queue_.top().rank == rank) {  // in position order
        const Index pos = queue_.top().pos;
        queue_.pop();
        if (rank_at(pos) == rank && (round.empty() || round.back() != pos)) round.push_back(pos);
      }
      if (round.empty()) continue;
      const uint32_t left = sym_[round.back()], right = sym_[next_[round.back()]];
      for (const Index pos : round) {
        if (gone_[pos] || next_[pos] >= n_) continue;  // taken by the merge before it ("a a a")
        if (sym_[pos] == left && sym_[next_[pos]] == right) {
          merge_at(pos);
        } else {
          queue_.push({rank, pos});  // another pair of this rank (GPT-2's comma aliasing): a later round
        }
      }
    }
    finish();
  }

 private:
  struct Candidate {
    uint32_t rank;
    Index pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  using Queue = std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>>;
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

  // The rank of the pair starting at pos now, or kNone.
  uint32_t rank_at(Index pos) const {
    if (gone_[pos] || next_[pos] >= n_) return kNone;
    auto it = merges_.find(pair_key(sym_[pos], sym_[next_[pos]]));
    return it == merges_.end() ? kNone : it->second.rank;
  }
  void push(Index pos, std::vector<Candidate>& into) {
    const uint32_t rank = rank_at(pos);
    if (rank != kNone) into.push_back({rank, pos});
  }
  void push(Index pos) {
    const uint32_t rank = rank_at(pos);
    if (rank != kNone) queue_.push({rank, pos});
  }
  void merge_at(Index pos) {
    const Index right = next_[pos];
    sym_[pos] = merges_.find(pair_key(sym_[pos], sym_[right]))->second.result;
    gone_[right] = true;
    next_[pos] = next_[right];
    if (next_[right] < n_) prev_[next_[right]] = pos;
    if (prev_[pos] < n_) push(prev_[pos]);
    if (next_[pos] < n_) push(pos);
  }
  void finish() {
    size_t w = 0;
    for (size_t i = 0; i < n_; ++i)
      if (!gone_[i]) sym_[w++] = sym_[i];
    sym_.resize(w);
  }

  std::vector<uint32_t>& sym_;
  const MergeTable& merges_;
  const size_t n_;
  std::vector<Index> prev_, next_;  // neighbours in the current word; n_ = none
  std::vector<bool> gone_;          // merged into the symbol on its left
  Queue queue_;
};

template <class Index>
void merge_word(std::vector<uint32_t>& sym, const MergeTable& merges, MergeOrder order) {
  MergeQueue<Index> q(sym, merges);
  if (order == MergeOrder::kHuggingFace) q.merge_one_at_a_time();
  else q.merge_by_rounds();
}

}  // namespace

void bpe_merge(std::vector<uint32_t>& sym, const MergeTable& merges, MergeOrder order) {
  if (sym.size() < 2) return;
  if (sym.size() < std::numeric_limits<uint32_t>::max()) merge_word<uint32_t>(sym, merges, order);
  else merge_word<uint64_t>(sym, merges, order);
}

}  // namespace lt::bpe
