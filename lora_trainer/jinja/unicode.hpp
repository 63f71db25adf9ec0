// The Jinja engine's strings: UTF-8 by code point, as Python's str (lengths, slices, indexing and case
// by code point). Internal to the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lt::jinja::detail {

// UTF-8 by code point, as Python's str.
std::vector<uint32_t> decode(const std::string& s);
void append_utf8(std::string& out, uint32_t cp);
std::string encode(const std::vector<uint32_t>& cps, size_t begin = 0, size_t end = std::string::npos);
bool is_space(uint32_t c);  // Python's str.isspace
// Python's str.upper/lower for Latin, Greek and Cyrillic. mode: 0 lower, 1 upper, 2 title, 3 capitalize.
uint32_t upper_cp(uint32_t c);
uint32_t lower_cp(uint32_t c);
bool cased(uint32_t c);
std::string change_case(const std::string& s, int mode);

}  // namespace lt::jinja::detail
