// Catch2 2 or 3, whichever CMake found (it defines LT_CATCH2_MAJOR). Every test file includes this
// instead of a Catch2 header, and uses lt::test::Contains for "the message contains this text".
#pragma once

#include <string>

#if defined(LT_CATCH2_MAJOR) && LT_CATCH2_MAJOR >= 3
#include <catch2/catch_all.hpp>
// Catch2 2 declares Approx at global scope; Catch2 3 only as Catch::Approx.
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif

namespace lt::test {

// A substring matcher. Catch2 2 calls it Matchers::Contains; in Catch2 3 that name is the range
// matcher ("has an element equal to") and the substring one is Matchers::ContainsSubstring.
#if defined(LT_CATCH2_MAJOR) && LT_CATCH2_MAJOR >= 3
inline Catch::Matchers::StringContainsMatcher Contains(const std::string& text,
                                                       Catch::CaseSensitive cs = Catch::CaseSensitive::Yes) {
  return Catch::Matchers::ContainsSubstring(text, cs);
}
#else
inline Catch::Matchers::StdString::ContainsMatcher Contains(const std::string& text,
                                                            Catch::CaseSensitive::Choice cs = Catch::CaseSensitive::Yes) {
  return Catch::Matchers::Contains(text, cs);
}
#endif

}  // namespace lt::test
