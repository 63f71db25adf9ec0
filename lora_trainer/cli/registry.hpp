// The built-in jobs by kind, and building a job from a config file or from a checkpoint. The one
// place that knows every job class; the launcher and the tests build jobs through it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lora_trainer/training/job.hpp"

namespace lt {

const JobRegistry& job_registry();

// Reads the kind ("job/kind") from a config file (or a job/kind override) and builds that job's
// Config: defaults < file < overrides.
Config make_config(const std::string& config_path, const std::vector<std::string>& overrides);

// make_config, then the job of that kind.
std::unique_ptr<RestorableJob> make_job(const std::string& name, const std::string& config_path,
                                         const std::string& out_dir, const std::vector<std::string>& overrides);

// Rebuilds the job saved in a checkpoint: its saved config, `overrides` on top, the class by its
// recorded kind, then restores the checkpoint's state into it. `name` "" keeps the saved name.
std::unique_ptr<RestorableJob> from_checkpoint_path(const std::string& checkpoint, const std::string& name,
                                                     const std::string& out_dir,
                                                     const std::vector<std::string>& overrides);

}  // namespace lt
