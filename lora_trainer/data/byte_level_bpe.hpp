// The parts of byte-level BPE that the gpt2 tokenizer (tokenizer.cpp, GPT-2's own files) and the
// Hugging Face tokenizer.json reader (hf_tokenizer.cpp) share: UTF-8 checks, GPT-2's byte <-> code point
// table, PCRE2 pre-tokenisation patterns, and the merge loop. Internal to the tokenizers.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lt::bpe {

void append_utf8(std::string& out, uint32_t cp);
// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there are not one;
// *valid_prefix is how many bytes were acceptable so far.
size_t utf8_sequence_length(std::string_view s, size_t i, size_t* valid_prefix);
// Replaces each maximal invalid subsequence by U+FFFD (WHATWG, as Node and Python's errors="replace").
std::string sanitize_utf8(std::string_view s);
bool is_valid_utf8(std::string_view s);
// `s` itself when it is valid UTF-8, else sanitize_utf8(s) kept in `storage`: what encode() works on.
std::string_view valid_utf8(std::string_view s, std::string& storage);

// Word -> ids already computed, shared by the encode() calls of one tokenizer and bounded in size
// (cleared when full, to bound memory on huge corpora). Words longer than kMaxWordBytes are not kept
// (the library's BPE cache has the same bound): a run of 12 million spaces is seen once. A call holds
// it through a Lease: the shared map when no other thread holds it, else a private one for that call,
// so calls never wait.
using WordIds = std::unordered_map<std::string, std::vector<uint32_t>>;
class WordCache {
 public:
  static constexpr size_t kMaxWords = size_t{1} << 20;
  static constexpr size_t kMaxWordBytes = 256;
  class Lease {
   public:
    explicit Lease(WordCache& c) : lock_(c.mutex_, std::try_to_lock), shared_(c.words_) {}
    WordIds& words() { return lock_.owns_lock() ? shared_ : private_; }

   private:
    std::unique_lock<std::mutex> lock_;
    WordIds& shared_;
    WordIds private_;
  };
  // Adds a word's ids to `words` (a leased map), clearing it first when it is full; a word longer than
  // kMaxWordBytes is not added.
  static void remember(WordIds& words, std::string word, std::vector<uint32_t> ids);

 private:
  std::mutex mutex_;
  WordIds words_;
};

// GPT-2's reversible byte -> code point table: printable Latin-1 bytes map to themselves, the other
// 68 bytes to U+0100.. in byte order, so every byte string is a printable token string.
std::vector<uint32_t> bytes_to_unicode();

// Bytes written through bytes_to_unicode(): the token string of a byte-level BPE vocabulary.
std::string bytes_to_token(std::string_view bytes);

// A token string written through bytes_to_unicode() back to its bytes; false if it is not one.
bool token_to_bytes(std::string_view token, const std::unordered_map<uint32_t, unsigned char>& cp_to_byte,
                    std::string* bytes);

struct PcreCodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
using Regex = std::unique_ptr<pcre2_code, PcreCodeDeleter>;

// What one caller needs to run a Regex: PCRE2's match data and match context, made on first use.
// One per thread (encode() keeps one per call).
class MatchData {
 public:
  MatchData() = default;
  MatchData(MatchData&&) noexcept = default;
  MatchData& operator=(MatchData&&) noexcept = default;

 private:
  friend bool regex_next(const Regex&, MatchData&, std::string_view, size_t, size_t*, size_t*);
  struct DataDeleter {
    void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
  };
  struct ContextDeleter {
    void operator()(pcre2_match_context* c) const { pcre2_match_context_free(c); }
  };
  std::unique_ptr<pcre2_match_data, DataDeleter> data_;
  std::unique_ptr<pcre2_match_context, ContextDeleter> context_;
};

// A pattern that could not be run to the end on a text: PCRE2's resource limits were reached (see
// regex_next). The message says where and which limit.
class RegexLimitError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Compiles with UTF and UCP (Unicode \p, \s, \w) and JIT where available. Throws std::runtime_error
// starting with `what` if the pattern does not compile; the message is PCRE2's.
Regex regex_compile(const std::string& pattern, const std::string& what);
// The next match at or after `pos` in valid UTF-8 `text`: true and [*begin, *end), or false if none.
//
// PCRE2's default limit of 10 million backtracking steps per match is too low for valid text under
// the real patterns: Llama 3's `\s*[\r\n]+` alone steps back over a whole run of spaces, so 12 million
// spaces exceed it. The limits here grow with the text: kMatchStepsBase + kMatchStepsPerByte steps per
// byte from `pos` to the end of `text` (and the same backtracking depth), which a pattern that does a
// bounded amount of work per character (every alternative scanning a run at most once: GPT-2's, Llama
// 3's, Qwen2's take 1 step per byte) always stays within, while a catastrophically backtracking one
// ("(a+)+$" on a long run of 'a' that does not end the text) still stops, after at most that many
// steps. The interpreter, used where JIT's stack is too small for a pattern, may hold kMatchHeapBytes.
// Throws RegexLimitError when a limit is reached, std::runtime_error on any other PCRE2 failure.
inline constexpr uint32_t kMatchStepsBase = 10'000'000;
inline constexpr uint32_t kMatchStepsPerByte = 64;
inline constexpr size_t kMatchHeapBytes = size_t{1} << 30;
bool regex_next(const Regex& re, MatchData& md, std::string_view text, size_t pos, size_t* begin, size_t* end);

// Merge rules: (left id, right id) -> rank (lower merges first) and the merged id.
struct Merge {
  uint32_t rank;
  uint32_t result;
};
using MergeTable = std::unordered_map<uint64_t, Merge>;
// The rules back as "left right" token strings in rank order (`token_of`: id -> its string).
std::vector<std::string> merge_strings(const MergeTable& merges, const std::vector<std::string>& token_of);
inline uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }

enum class MergeOrder {
  // Encoder.js (gpt-3-encoder): take the lowest-ranked pair (the last one on a tie) and merge every
  // occurrence of it, left to right.
  kEncoderJs,
  // Hugging Face tokenizers: merge the lowest-ranked pair, the leftmost on a tie, one at a time.
  kHuggingFace,
};
// Merges the symbols of one word in place until no adjacent pair has a rank. Both orders run through
// a priority queue of candidate pairs (as the library does), so a word of n bytes takes O(n log n)
// whatever its merges: a pretoken of 12 million spaces takes seconds, not the hours of one scan of the
// word per merge.
void bpe_merge(std::vector<uint32_t>& sym, const MergeTable& merges, MergeOrder order);

}  // namespace lt::bpe
