#include "lora_trainer/core/dataset_style.hpp"

#include "lora_trainer/core/util.hpp"

namespace lt {

const std::vector<std::string>& dataset_style_names() {
  static const std::vector<std::string> names = {"pmd", "padded", "contrastive"};
  return names;
}

std::string style_name(DatasetStyle s) { return dataset_style_names().at(static_cast<size_t>(s)); }

DatasetStyle parse_dataset_style(const std::string& name, const std::string& where) {
  const auto& names = dataset_style_names();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<DatasetStyle>(i);
  throw UserError(where + ": style \"" + name + "\" is none of " + dataset_style_choices());
}

std::string dataset_style_choices() {
  const auto& names = dataset_style_names();
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + ("\"" + names[i] + "\"");
  return out;
}

}  // namespace lt
