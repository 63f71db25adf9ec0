// The Jinja engine's strings (jinja/unicode.hpp): UTF-8 by code point, as Python's str.
#include "lora_trainer/jinja/unicode.hpp"

#include "lora_trainer/jinja/limits.hpp"

namespace lt::jinja::detail {

std::vector<uint32_t> decode(const std::string& s) {
  charge_bytes(s.size());
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  end = std::min(end, cps.size());
  if (begin < end) check_string(end - begin);
  for (size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
  return out;
}

bool is_space(uint32_t c) {  // Python's str.isspace
  return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Python's str.upper/lower for Latin (Basic, Latin-1, Extended-A), Greek and Cyrillic; other
// scripts are left as they are.
bool latin_a_odd_pairs(uint32_t c) { return (c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177); }
bool latin_a_even_pairs(uint32_t c) { return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e); }

uint32_t upper_cp(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0xb5) return c;
  if (c == 0xb5) return 0x39c;
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 32;
  if (c == 0xff) return 0x178;
  if (c == 0x131) return 'I';
  if (c == 0x17f) return 'S';
  if (latin_a_odd_pairs(c)) return c % 2 ? c - 1 : c;
  if (latin_a_even_pairs(c)) return c % 2 ? c : c - 1;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x3b1 && c <= 0x3cb) return c - 32;
  if (c == 0x3ac) return 0x386;
  if (c >= 0x3ad && c <= 0x3af) return c - 37;
  if (c == 0x3cc) return 0x38c;
  if (c == 0x3cd || c == 0x3ce) return c - 63;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}

uint32_t lower_cp(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0xc0) return c;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  if (c == 0x178) return 0xff;
  if (latin_a_odd_pairs(c)) return c % 2 ? c : c + 1;
  if (latin_a_even_pairs(c)) return c % 2 ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3ab && c != 0x3a2) return c + 32;
  if (c == 0x386) return 0x3ac;
  if (c >= 0x388 && c <= 0x38a) return c + 37;
  if (c == 0x38c) return 0x3cc;
  if (c == 0x38e || c == 0x38f) return c + 63;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}

bool cased(uint32_t c) { return upper_cp(c) != c || lower_cp(c) != c || c == 0xdf; }

// 0 lower, 1 upper, 2 title (first cased letter of each run upper, the rest lower), 3 capitalize.
std::string change_case(const std::string& s, int mode) {
  std::string out;
  bool prev_cased = false;
  size_t k = 0;
  for (uint32_t c : decode(s)) {
    const bool up = mode == 1 || (mode == 2 && !prev_cased) || (mode == 3 && k == 0);
    if (up && c == 0xdf) out += "SS";  // ß
    else append_utf8(out, up ? upper_cp(c) : lower_cp(c));
    prev_cased = cased(c);
    ++k;
  }
  return out;
}

}  // namespace lt::jinja::detail
