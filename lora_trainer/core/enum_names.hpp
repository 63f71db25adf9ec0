// An enum's spellings. An enum whose values a config key, a flag or a file spells keeps one table:
// its names in the enum's order, returned by one function (`schedule_kind_names()`, in the file of the
// enum). Its parser and printer are these templates over that table, so a name is written once and
// the loops are written once.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lora_trainer/core/util.hpp"

namespace lt {

// The value of E named `name`, or nothing.
template <class E>
std::optional<E> enum_from_name(const std::vector<std::string>& names, const std::string& name) {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<E>(i);
  return std::nullopt;
}

// The name of `value` (a logic error for a value outside the table: a table out of step with its enum).
template <class E>
const std::string& enum_name(const std::vector<std::string>& names, E value) {
  const auto i = static_cast<size_t>(value);
  if (i >= names.size()) throw std::logic_error("enum_name: value " + std::to_string(i) + " has no name in {" + join(names) + "}");
  return names[i];
}

// The value of E named `name`, for a config key: a UserError naming `key` and the names otherwise.
template <class E>
E enum_named(const std::vector<std::string>& names, const std::string& name, const std::string& key) {
  if (auto value = enum_from_name<E>(names, name)) return *value;
  throw UserError(key + ": \"" + name + "\" is not one of " + join(names));
}

}  // namespace lt
