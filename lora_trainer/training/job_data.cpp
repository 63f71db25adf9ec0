#include "lora_trainer/training/job_data.hpp"

#include <algorithm>

#include "lora_trainer/core/util.hpp"

namespace lt {

JobData::JobData(const std::string& data_dir, int64_t vocab_size, bool pack, const StagePlan& plan, int64_t batch_size,
                 int64_t block_size, uint64_t seed, DatasetCheck check)
    : catalog_(data_dir, vocab_size, pack),
      stages_(split_stages(plan, batch_size * block_size)),
      samplers_(stages_.size()),
      batch_size_(batch_size),
      block_size_(block_size),
      vocab_size_(vocab_size),
      seed_(seed),
      check_(std::move(check)) {}

const Dataset& JobData::open(const Sampling& smp) {
  const Dataset& ds = catalog_.get(smp);
  const int64_t vocab = ds.meta().value("vocab_size", int64_t(0));
  if (vocab > vocab_size_)
    throw UserError("dataset \"" + smp.name + "\" was tokenized with a vocabulary of " + std::to_string(vocab) +
                    " ids, but architecture/vocab_size is " + std::to_string(vocab_size_) +
                    "; raise architecture/vocab_size or re-tokenize");
  return ds;
}

void JobData::open_all() {
  check_(datasets());
  for (const auto& s : datasets()) open(s);
}

MixtureSampler& JobData::sampler(int stage, int64_t step) {
  auto& s = samplers_.at(static_cast<size_t>(stage));
  if (s) return *s;
  const Stage& st = stages_[static_cast<size_t>(stage)];
  check_(st.samplings);
  for (const auto& smp : st.samplings) open(smp);
  s = std::make_unique<MixtureSampler>(catalog_, st.samplings, block_size_, seed_, static_cast<uint64_t>(stage));
  // A sampler made after a restore continues where the checkpoint says it was; one made fresh starts
  // at the stage's position by the step count (rows drawn before, e.g. in a fade, are only known from
  // a checkpoint).
  uint64_t cursor = static_cast<uint64_t>(std::max<int64_t>(0, step - st.first_step) * batch_size_);
  if (auto restored = restored_cursors_.find(stage); restored != restored_cursors_.end()) {
    cursor = restored->second;
    restored_cursors_.erase(restored);
  }
  s->set_cursor(cursor);
  return *s;
}

std::map<int, uint64_t> JobData::cursors() const {
  std::map<int, uint64_t> out;
  for (size_t i = 0; i < samplers_.size(); ++i) {
    const int stage = static_cast<int>(i);
    if (samplers_[i]) out[stage] = samplers_[i]->cursor();
    else if (auto restored = restored_cursors_.find(stage); restored != restored_cursors_.end()) out[stage] = restored->second;
  }
  return out;
}

void JobData::restore(std::map<int, uint64_t> cursors) {
  for (auto& s : samplers_) s.reset();
  restored_cursors_ = std::move(cursors);
}

}  // namespace lt
