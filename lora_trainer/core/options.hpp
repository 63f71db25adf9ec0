// A component's options declared once: each key with its type, default, doc and check, bound to the
// field of the component's options struct that it sets. `declare` adds the keys to a job's schema
// (config.hpp); `read` fills the struct from a Config. There is no second list of keys to keep in
// step with the first: a key is read into the field it was declared with, or not at all.
//
//   static const OptionGroup<ContinualOptions>& continual_options() {
//     static const auto g = OptionGroup<ContinualOptions>()
//         .add("training/reset_optimizer", OptType::Bool, false, "reset ...", &ContinualOptions::reset_optimizer)
//         .add("training/fade/curve", OptType::String, "linear", "fade curve ...",
//              [](ContinualOptions& o, const json& v) { o.fade_curve = parse_fade_curve(v); }, check_one_of(...));
//     return g;
//   }
//
// A field bound by member pointer takes the value as nlohmann::json converts it (integers, numbers,
// booleans, strings, lists); a setter converts anything else (an enum from its name, a nested field).
// A key that a job's schema lacks (a kind that removed it) leaves its field at the struct's initialiser.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "lora_trainer/core/config.hpp"
#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"

namespace lt {

template <class Opts>
class OptionGroup {
 public:
  using Setter = std::function<void(Opts&, const json&)>;

  OptionGroup& add(std::string path, OptType type, json default_value, std::string doc, Setter set, OptCheck check = {}) {
    specs_.push_back({std::move(path), type, std::move(default_value), std::move(doc), std::move(check)});
    setters_.push_back(std::move(set));
    return *this;
  }
  template <class T>
  OptionGroup& add(std::string path, OptType type, json default_value, std::string doc, T Opts::*field,
                   OptCheck check = {}) {
    return add(std::move(path), type, std::move(default_value), std::move(doc),
               Setter([field](Opts& o, const json& v) { o.*field = v.get<T>(); }), std::move(check));
  }

  // Adds every key to `s`, in the order declared.
  void declare(ConfigSchema& s) const {
    for (const auto& o : specs_) s.add(o.path, o.type, o.default_value, o.doc, o.check);
  }
  // The options `cfg` gives; a key not in cfg's schema keeps the field's initialiser.
  Opts read(const Config& cfg) const {
    Opts out;
    read_into(cfg, out);
    return out;
  }
  // The fields of `out` that `cfg` gives set from it; the others (and keys not in cfg's schema) unchanged.
  void read_into(const Config& cfg, Opts& out) const {
    for (size_t i = 0; i < specs_.size(); ++i)
      if (cfg.schema().find(specs_[i].path)) setters_[i](out, cfg.get(specs_[i].path));
  }
  const std::vector<OptionSpec>& specs() const { return specs_; }

 private:
  std::vector<OptionSpec> specs_;
  std::vector<Setter> setters_;
};

}  // namespace lt
