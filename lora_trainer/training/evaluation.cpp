#include "lora_trainer/training/evaluation.hpp"

#include <algorithm>

namespace lt {

std::vector<DatasetEval> held_out_loss(CausalLM& model, const std::vector<Sampling>& datasets, int64_t rows,
                                       const std::function<const Dataset&(const Sampling&)>& open, EvalShape shape,
                                       const Runtime& rt, Distributed& dist) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  std::vector<DatasetEval> out;
  auto sums = torch::zeros({static_cast<int64_t>(datasets.size()), 2}, torch::kFloat64);  // [dataset, (loss sum, tokens)]
  for (size_t d = 0; d < datasets.size(); ++d) {
    const Dataset& ds = open(datasets[d]);
    double loss_sum_total = 0, tokens = 0;
    for_rank_micro_batches(rows, shape.micro_batch, dist, !model->block_shards().empty(), [&](int64_t first, int64_t n, bool counted) {
      Batch b = validation_rows(ds, shape.block_size, static_cast<uint64_t>(first), n);
      AutocastGuard autocast(rt);
      const Batch on = b.map([&](const torch::Tensor& t) { return rt.to_device(t); });
      auto loss_sum = model->loss_sum(on.inputs, on.targets, on.segments);
      if (!counted) return;
      loss_sum_total += loss_sum.item<double>();
      tokens += static_cast<double>(count_targets(b.targets));
    });
    sums[static_cast<int64_t>(d)][0] = loss_sum_total;
    sums[static_cast<int64_t>(d)][1] = tokens;
  }
  dist.all_reduce_sum({sums}, "the validation loss sum");
  for (size_t d = 0; d < datasets.size(); ++d) {
    DatasetEval e;
    e.name = datasets[d].name;
    e.style = datasets[d].style;
    e.tokens = static_cast<int64_t>(sums[static_cast<int64_t>(d)][1].item<double>());
    e.loss = sums[static_cast<int64_t>(d)][0].item<double>() / static_cast<double>(std::max<int64_t>(1, e.tokens));
    out.push_back(e);
  }
  if (was_training) model->train();
  return out;
}

void for_rank_micro_batches(int64_t rows, int64_t micro, const Distributed& dist, bool lockstep,
                            const std::function<void(int64_t first, int64_t n, bool counted)>& fn) {
  const int64_t ranks = dist.world_size(), batches = (rows + micro - 1) / micro;
  const int64_t rounds = (batches + ranks - 1) / ranks;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t k = round * ranks + dist.rank();
    if (k < batches) fn(k * micro, std::min(micro, rows - k * micro), true);
    else if (lockstep) fn(0, std::min(micro, rows), false);
  }
}

ValResult validation_score(std::vector<DatasetEval> per_dataset, const std::vector<Sampling>& scored) {
  ValResult out;
  out.per_dataset = std::move(per_dataset);
  double loss = 0;
  for (const auto& e : out.per_dataset) {
    if (std::none_of(scored.begin(), scored.end(), [&](const Sampling& x) { return x.name == e.name && x.style == e.style; }))
      continue;
    loss += e.loss * static_cast<double>(e.tokens);
    out.tokens += e.tokens;
  }
  out.loss = loss / static_cast<double>(std::max<int64_t>(1, out.tokens));
  return out;
}

}  // namespace lt
