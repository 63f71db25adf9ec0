// The styles of a dataset by name: one table that the config's check of a sampling's "style"
// (config.cpp, OptType::Samplings), the datasets that read a meta.json (data.hpp) and the tokenize step
// that writes one (tokenize.cpp) all go through.
#pragma once

#include <string>
#include <vector>

namespace lt {

// How a dataset's files are laid out (data.hpp): a token stream, left-padded rows, padded rows in
// chosen/rejected pairs, or prompts with their records (prompts.hpp). Its names, in the enum's order:
// "pmd", "padded", "contrastive", "prompts".
enum class DatasetStyle { PMD, PADDED, CONTRASTIVE, PROMPTS };
const std::vector<std::string>& dataset_style_names();
// Its name: the one printer.
std::string style_name(DatasetStyle s);
// The one parser: the style named `name`; a UserError naming `where` and the styles for another.
DatasetStyle parse_dataset_style(const std::string& name, const std::string& where);
// The names as messages offer them: "\"pmd\", \"padded\" or \"contrastive\"".
std::string dataset_style_choices();

}  // namespace lt
