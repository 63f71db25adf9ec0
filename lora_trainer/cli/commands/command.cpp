#include "lora_trainer/cli/commands/command.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <filesystem>

#include "lora_trainer/cli/registry.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/formats/checkpoint.hpp"
#include "lora_trainer/formats/hf_families.hpp"
#include "lora_trainer/training/trainer.hpp"

namespace fs = std::filesystem;

namespace lt {

CLI::Validator tokenizer_name(std::vector<std::string> names) {
  std::string desc = join(names, "|") + "|hf:DIR";
  return CLI::Validator(
      [names](std::string& text) -> std::string {
        if (text.rfind("hf:", 0) == 0 && text.size() > 3) return "";
        for (const auto& n : names)
          if (text == n) return "";
        return "\"" + text + "\" is not a tokenizer: use " + join(names, ", ") + " or hf:DIR";
      },
      desc);
}

CLI::Validator dir_name() {
  return CLI::Validator([](std::string& text) { return name_problem(text); }, "NAME");
}

CLI::Validator uint64_text() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string bad = "must be a whole number from 0 to 18446744073709551615, got \"" + text + "\"";
        if (text.empty() || text.size() > 20 || text.find_first_not_of("0123456789") != std::string::npos) return bad;
        if (text.size() == 20 && text > "18446744073709551615") return bad;
        return "";
      },
      "UINT64");
}

CLI::Validator finite_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0') return "\"" + text + "\" is not a number";
        if (!std::isfinite(v) || v < lo || v > hi) {
          char b[96];
          std::snprintf(b, sizeof b, "must be a finite number from %g to %g, got %s", lo, hi, text.c_str());
          return b;
        }
        return "";
      },
      "NUMBER in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

void check_out_dir(const std::string& out_dir) {
  if (out_dir.find('=') != std::string::npos)
    throw UserError("OUT_DIR \"" + out_dir + "\" looks like a key=value override: give the output directory " +
                    "first (`.` for this directory), then the overrides");
}

// --restore HF_DIR: the model's architecture from its config.json, over the config file's and before
// the command line's overrides (which a mismatch then reports). A rotary model's block_size (the rows'
// length) stays the config's: it is the job's choice, not the weights'.
std::vector<std::string> with_model_dir_architecture(const std::string& restore, const std::vector<std::string>& overrides,
                                                     FILE* note) {
  using nlohmann::json;
  if (restore.empty() || is_checkpoint(restore) || !is_hf_model_dir(restore)) return overrides;
  const std::string path = (fs::path(restore) / "config.json").string();
  const json hf = read_json_file(path);
  if (!hf.is_object()) throw UserError(path + ": not a JSON object");
  std::vector<std::string> arch = json_context(path, [&] {
    const bool rotary = hf_family(hf, path) == ModelFamily::Llama;
    std::vector<std::string> out;
    for (const auto& a : hf_architecture(hf, path))
      if (!(rotary && a.rfind("architecture/block_size=", 0) == 0)) out.push_back(a);
    return out;
  });
  if (note) std::fprintf(note, "the model's architecture, from %s: %s\n", path.c_str(), join(arch, " ").c_str());
  arch.insert(arch.end(), overrides.begin(), overrides.end());
  return arch;
}

std::unique_ptr<RestorableJob> load_for_reading(const std::string& checkpoint, const std::vector<std::string>& overrides,
                                                Trainer** trainer) {
  auto job = from_checkpoint_path(checkpoint, "", "/nonexistent-lora-trainer-out", overrides);
  *trainer = dynamic_cast<Trainer*>(job.get());
  if (!*trainer) throw UserError(checkpoint + " is not a checkpoint of a training job");
  return job;
}

}  // namespace lt
