#include "lora_trainer/formats/lora_metadata.hpp"

#include <cmath>

#include "lora_trainer/core/util.hpp"

namespace lt {

using json = nlohmann::json;

json LoraMetadata::to_json() const {
  json j = {{"rank", rank},
            {"alpha", alpha},
            {"targets", targets},
            {"init", to_string(init)},
            {"rslora", rslora},
            {"dora", dora},
            {"lr_ratio", lr_ratio},
            {"modules_to_save", modules_to_save},
            {"modules_to_save_lr_ratio", modules_to_save_lr_ratio},
            {"trainable_tokens", json(trainable_tokens)},  // {} for none
            {"adapters_from", adapters_from},
            {"quantize_base", to_string(quantize_base)},
            {"quantized", json(quantized)},
            {"base", base}};
  if (boundary_step) j["boundary_step"] = *boundary_step;
  if (in_lora_phase) j["in_lora_phase"] = *in_lora_phase;
  return j;
}

LoraMetadata LoraMetadata::from_json(const json& l, const std::string& file) {
  const std::string tail = ". The checkpoint is damaged or hand-edited; " + use_another_checkpoint();
  if (!l.is_object()) throw UserError(file + ": \"lora\" must be an object, not " + l.dump() + tail);
  LoraMetadata m;
  // json_context names the file and the field of a type error.
  json_context(file, [&] {
    m.rank = l.at("rank").get<int64_t>();
    m.alpha = l.at("alpha").get<double>();
    if (l.contains("boundary_step")) m.boundary_step = l["boundary_step"].get<int64_t>();
    if (l.contains("in_lora_phase")) m.in_lora_phase = l["in_lora_phase"].get<bool>();
    m.targets = l.value("targets", std::vector<std::string>());
    if (l.contains("init")) {
      try {
        m.init = parse_lora_init(l["init"].get<std::string>());
      } catch (const LoraSettingError& e) {
        throw UserError(file + ": lora.init: " + e.what() + tail);
      }
    }
    m.rslora = l.value("rslora", false);
    m.dora = l.value("dora", false);
    m.lr_ratio = l.value("lr_ratio", 1.0);
    m.modules_to_save = l.value("modules_to_save", std::vector<std::string>());
    m.modules_to_save_lr_ratio = l.value("modules_to_save_lr_ratio", 1.0);
    const json tokens = l.value("trainable_tokens", json::object());
    for (const auto& [name, ids] : tokens.items()) m.trainable_tokens[name] = ids.get<std::vector<int64_t>>();
    m.adapters_from = l.value("adapters_from", std::string());
    try {
      m.quantize_base = parse_frozen_format(l.value("quantize_base", std::string("bf16")));
    } catch (const std::invalid_argument& e) {
      throw UserError(file + ": lora.quantize_base: " + e.what() + tail);
    }
    const json quantized = l.value("quantized", json::object());
    if (!quantized.is_object())
      throw UserError(file + ": lora.quantized is " + quantized.dump() + ", not an object of weight names and shapes" + tail);
    // Each NF4 weight's shape is allocated as it stands when the checkpoint is read: a linear layer's
    // (out, in), each dimension positive and the product well inside 64 bits.
    for (const auto& [name, shape] : quantized.items()) {
      bool fits = shape.is_array() && shape.size() == 2;
      for (const auto& d : fits ? shape : json::array())
        fits = fits && d.is_number_integer() && d.get<int64_t>() >= 1 && d.get<int64_t>() <= (int64_t(1) << 20);
      if (!fits)
        throw UserError(file + ": lora.quantized[\"" + name + "\"] is " + shape.dump() + ", not the shape of a linear "
                        "layer's weight (two dimensions, each from 1 to 2^20)" + tail);
      m.quantized[name] = shape.get<std::vector<int64_t>>();
    }
    m.base = l.value("base", json());
  });
  if (m.rank < 1 || !std::isfinite(m.alpha))
    throw UserError(file + ": lora.rank " + std::to_string(m.rank) + " and lora.alpha " + json(m.alpha).dump() +
                    ": the rank is a positive integer and alpha a finite number" + tail);
  if (!m.quantized.empty() && !frozen_storage(m.quantize_base).quantizes())
    throw UserError(file + ": lora.quantized lists " + std::to_string(m.quantized.size()) + " weights stored quantized, and "
                    "lora.quantize_base is \"" + to_string(m.quantize_base) + "\"" + tail);
  if (m.trainable_tokens.size() > 1)
    throw UserError(file + ": lora.trainable_tokens names " + std::to_string(m.trainable_tokens.size()) +
                    " embeddings; a model has one token embedding" + tail);
  return m;
}

}  // namespace lt
