#include "lora_trainer/core/dataset_style.hpp"

#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

const std::vector<std::string>& dataset_style_names() {
  static const std::vector<std::string> names = {"pmd", "padded", "contrastive", "prompts"};
  return names;
}

std::string style_name(DatasetStyle s) { return enum_name(dataset_style_names(), s); }

DatasetStyle parse_dataset_style(const std::string& name, const std::string& where) {
  if (auto value = enum_from_name<DatasetStyle>(dataset_style_names(), name)) return *value;
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
