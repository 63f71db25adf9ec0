// The Catch2 test runner's main() with Catch2 2. With Catch2 3 it comes from Catch2::Catch2WithMain
// and CMakeLists.txt leaves this file out.
#define CATCH_CONFIG_MAIN
#include "catch.hpp"
