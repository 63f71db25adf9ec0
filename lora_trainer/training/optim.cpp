#include "lora_trainer/training/optim.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "lora_trainer/core/torch_compat.hpp"
#include "lora_trainer/core/enum_names.hpp"
#include "lora_trainer/core/util.hpp"
#include "lora_trainer/peft/lora.hpp"
#include "lora_trainer/kernels/adamw.hpp"
#include "lora_trainer/kernels/parallel.hpp"

namespace lt {

namespace {

// The fused CPU kernels take f32 arrays of the same length, contiguous, on the CPU.
bool plain_f32(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.layout() == torch::kStrided;
}

// Pieces of at most kChunk values that the threads share: large enough to keep a thread streaming,
// small enough that a model's few large matrices spread over every thread.
constexpr int64_t kChunk = int64_t(1) << 16;
struct Chunk {
  size_t tensor;
  int64_t begin, end;
};
void add_chunks(std::vector<Chunk>& out, size_t tensor, int64_t n) {
  for (int64_t b = 0; b < n; b += kChunk) out.push_back({tensor, b, std::min(n, b + kChunk)});
}

}  // namespace

AdamW::AdamW(NamedTensors params, AdamWOptions opts, std::vector<double> lr_scale)
    : params_(std::move(params)), o_(opts), lr_scale_(std::move(lr_scale)) {
  if (lr_scale_.empty()) lr_scale_.assign(params_.size(), 1.0);
  TORCH_CHECK(lr_scale_.size() == params_.size(), "AdamW: ", lr_scale_.size(), " lr scales for ", params_.size(), " parameters");
  for (const auto& [name, p] : params_) {
    m_.emplace_back();  // made at the first step or state(), after shard() said which this rank keeps
    v_.emplace_back();
    decay_.push_back(p.dim() >= 2);
  }
}

std::vector<ParamRule> parse_param_rules(const nlohmann::json& v) {
  std::vector<ParamRule> out;
  for (const auto& r : v) {
    ParamRule p;
    p.match = r.at("match").get<std::string>();
    p.lr_ratio = r.value("lr_ratio", 1.0);
    if (r.contains("weight_decay")) p.weight_decay = r["weight_decay"].get<bool>() ? 1 : 0;
    out.push_back(p);
  }
  return out;
}

int match_param_rule(const std::vector<ParamRule>& rules, const std::string& name) {
  for (size_t i = 0; i < rules.size(); ++i)
    if (name.find(rules[i].match) != std::string::npos) return static_cast<int>(i);
  return -1;
}

void check_param_rules(const std::vector<ParamRule>& rules, const NamedTensors& params) {
  for (const auto& rule : rules) {
    std::vector<std::string> names;
    for (const auto& [n, p] : params) {
      names.push_back(n);
      if (p.dim() == 2)
        names.insert(names.end(), {LoraParams::a_name(n), LoraParams::b_name(n), LoraParams::magnitude_name(n)});
    }
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return n.find(rule.match) != std::string::npos; }))
      throw UserError("optimization/param_groups: \"" + rule.match + "\" matches no parameter of this model (nor an "
                      "adapter's lora_A/lora_B/lora_magnitude); names look like " + names.front() + ", " + names[names.size() / 2]);
  }
}

std::vector<int> apply_param_rules(const std::vector<ParamRule>& rules, const NamedTensors& params,
                                   std::vector<double>& lr_scale) {
  std::vector<int> rule_of;
  for (size_t i = 0; i < params.size(); ++i) {
    rule_of.push_back(match_param_rule(rules, params[i].first));
    if (rule_of.back() >= 0) lr_scale[i] *= rules[static_cast<size_t>(rule_of.back())].lr_ratio;
  }
  return rule_of;
}

std::string describe_param_groups(const std::vector<ParamRule>& rules, const std::vector<int>& rule_of,
                                  const NamedTensors& params) {
  std::string out;
  for (size_t r = 0; r < rules.size(); ++r) {
    std::vector<std::string> names;
    for (size_t i = 0; i < rule_of.size(); ++i)
      if (rule_of[i] == static_cast<int>(r)) names.push_back(params[i].first);
    char what[96];
    std::snprintf(what, sizeof what, "lr x%g%s", rules[r].lr_ratio,
                  rules[r].weight_decay < 0 ? "" : rules[r].weight_decay ? ", weight decay" : ", no weight decay");
    std::string shown = names.size() <= 4 ? join(names)
                                          : join(std::vector<std::string>(names.begin(), names.begin() + 3)) + ", ... (" +
                                                std::to_string(names.size()) + " in all)";
    out += "param group " + std::to_string(r) + " (match \"" + rules[r].match + "\", " + what +
           "): " + (names.empty() ? std::string("no trainable parameter now") : shown) + "\n";
  }
  return out;
}

std::vector<std::string> AdamW::param_names() const {
  std::vector<std::string> out;
  for (const auto& p : params_) out.push_back(p.first);
  return out;
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.second.grad().defined()) p.second.mutable_grad() = torch::Tensor();
}

void AdamW::make_moments() const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (owns(i) && !m_[i].defined()) {
      m_[i] = torch::zeros_like(params_[i].second, torch::kFloat32);
      v_[i] = torch::zeros_like(params_[i].second, torch::kFloat32);
    }
}

void AdamW::step(double lr) {
  torch::NoGradGuard ng;
  make_moments();
  ++t_;
#if LT_HAS_FUSED_ADAMW
  if (!params_.empty() && params_.front().second.is_cuda()) return fused_step(lr);
#endif
  const double bc1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t_));
  const double inv_sqrt_bc2 = 1.0 / std::sqrt(bc2);
  // f32 parameters on the CPU: one pass over each (kernels/adamw.hpp), the threads sharing the chunks.
  std::vector<AdamWScalars> scalars(params_.size());
  std::vector<std::array<float*, 4>> data(params_.size());  // p, g, m, v
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i].second;
    const auto& g = p.grad();
    if (!g.defined() || !owns(i) || !plain_f32(p) || !plain_f32(g) || !plain_f32(m_[i]) || !plain_f32(v_[i]) ||
        g.numel() != p.numel())
      continue;
    const double lr_i = lr * lr_scale_[i];
    AdamWScalars& c = scalars[i];
    c.decay = decay_[i] && o_.weight_decay != 0 ? static_cast<float>(1.0 - lr_i * o_.weight_decay) : 1.0f;
    c.beta1 = static_cast<float>(o_.beta1);
    c.beta2 = static_cast<float>(o_.beta2);
    c.one_minus_beta1 = static_cast<float>(1.0 - o_.beta1);
    c.one_minus_beta2 = static_cast<float>(1.0 - o_.beta2);
    c.inv_sqrt_bc2 = static_cast<float>(inv_sqrt_bc2);
    c.eps = static_cast<float>(o_.eps);
    c.step_size = static_cast<float>(lr_i / bc1);
    data[i] = {p.data_ptr<float>(), g.data_ptr<float>(), m_[i].data_ptr<float>(), v_[i].data_ptr<float>()};
    add_chunks(chunks, i, p.numel());
    p.unsafeGetTensorImpl()->bump_version();  // changed in place, as an in-place op would report
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Chunk& c = chunks[static_cast<size_t>(k)];
      const auto& d = data[c.tensor];
      adamw_update(d[0] + c.begin, d[1] + c.begin, d[2] + c.begin, d[3] + c.begin, c.end - c.begin, scalars[c.tensor]);
    }
  });
  // Anything else (another dtype or device, a strided tensor): LibTorch's ops, tensor by tensor.
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i].second;
    const auto& g = p.grad();
    if (!g.defined() || !owns(i) || data[i][0] != nullptr) continue;  // updated above
    const double lr_i = lr * lr_scale_[i];
    const double step_size = lr_i / bc1;
    if (decay_[i] && o_.weight_decay != 0) p.mul_(1.0 - lr_i * o_.weight_decay);
    m_[i].mul_(o_.beta1).add_(g, 1.0 - o_.beta1);
    v_[i].mul_(o_.beta2).addcmul_(g, g, 1.0 - o_.beta2);
    auto denom = (v_[i].sqrt() * inv_sqrt_bc2).add_(o_.eps);
    p.addcdiv_(m_[i], denom, -step_size);
  }
}

#if LT_HAS_FUSED_ADAMW
// CUDA: LibTorch's fused AdamW kernel (the one torch.optim.AdamW(fused=True) runs), one launch per
// group of tensors instead of six per tensor; the same update as the loop above, in a different
// order of rounding. One group per (weight decay or not, lr scale).
void AdamW::fused_step(double lr) {
  const auto& first = params_.front().second;
  auto step = torch::full({}, static_cast<double>(t_), first.options().dtype(torch::kFloat32));
  std::vector<std::pair<bool, double>> groups;
  for (size_t i = 0; i < params_.size(); ++i)
    if (std::find(groups.begin(), groups.end(), std::make_pair(bool(decay_[i]), lr_scale_[i])) == groups.end())
      groups.emplace_back(decay_[i], lr_scale_[i]);
  for (const auto& [decay, scale] : groups) {
    std::vector<torch::Tensor> ps, gs, ms, vs, steps;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i].second;
      if (!p.grad().defined() || !owns(i) || decay_[i] != decay || lr_scale_[i] != scale) continue;
      ps.push_back(p);
      gs.push_back(p.grad());
      ms.push_back(m_[i]);
      vs.push_back(v_[i]);
      steps.push_back(step);
    }
    if (ps.empty()) continue;
    at::_fused_adamw_(ps, gs, ms, vs, /*max_exp_avg_sqs=*/{}, steps, lr * scale, o_.beta1, o_.beta2,
                      decay ? o_.weight_decay : 0.0, o_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}
#endif

NamedTensors AdamW::state() const {
  make_moments();
  NamedTensors out;
  auto held = [&](size_t i, const torch::Tensor& t) {
    return owns(i) ? t : torch::zeros_like(params_[i].second, torch::kFloat32);
  };
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back("optim/exp_avg/" + params_[i].first, held(i, m_[i]));
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back("optim/exp_avg_sq/" + params_[i].first, held(i, v_[i]));
  out.emplace_back("optim/step", torch::tensor(t_, torch::kLong));
  return out;
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    if (owns(i)) b += 2 * params_[i].second.numel() * 4;
  return b;
}

void AdamW::shard(int rank, int world) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "AdamW::shard: rank ", rank, " of ", world);
  rank_ = rank;
  world_ = world;
  owner_.assign(params_.size(), 0);
  if (world == 1) {
    owner_.clear();
    return;
  }
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params_[a].second.numel() > params_[b].second.numel(); });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  for (size_t i : order) {
    int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner_[i] = r;
    load[static_cast<size_t>(r)] += params_[i].second.numel();
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (!owns(i)) m_[i] = v_[i] = torch::Tensor();  // freed: another rank keeps them
}

double clip_grad_norm(const NamedTensors& params, double max_norm) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.second.grad().defined()) grads.push_back(p.second.grad());
  if (grads.empty()) return 0.0;
#if LT_TORCH_AT_LEAST(2, 0)
  if (grads.front().is_cuda()) {
    // CUDA: one multi-tensor kernel for the norms (as torch.nn.utils.clip_grad_norm_ does), and the
    // one read back of the step.
    const double norm = at::stack(at::_foreach_norm(grads, 2)).to(torch::kFloat64).pow(2).sum().sqrt().item<double>();
    if (max_norm > 0 && norm > max_norm) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
    return norm;
  }
#endif
  // Every gradient whole on every rank: no pieces, whose sum (0.0) adds nothing.
  return clip_grad_norm(params, max_norm, std::vector<bool>(params.size(), false), [](double none) { return none; });
}

double clip_grad_norm(const NamedTensors& params, double max_norm, const std::vector<bool>& piece,
                      const std::function<double(double)>& sum_pieces) {
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> grads, whole_sq, piece_sq;
  // f32 gradients on the CPU: squares summed in one pass (kernels/adamw.hpp), in chunks the threads
  // share, each chunk's sum kept and added in order (the same norm whatever the thread count).
  std::vector<Chunk> chunks;
  std::vector<const float*> data(params.size(), nullptr);
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g = params[i].second.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (plain_f32(g)) {
      data[i] = g.data_ptr<float>();
      add_chunks(chunks, i, g.numel());
    }
    else (piece.at(i) ? piece_sq : whole_sq).push_back(g.to(torch::kFloat32).pow(2).sum());
  }
  std::vector<double> chunk_sq(chunks.size());
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Chunk& c = chunks[static_cast<size_t>(k)];
      chunk_sq[static_cast<size_t>(k)] = sum_of_squares(data[c.tensor] + c.begin, c.end - c.begin);
    }
  });
  double whole_sum = 0.0, piece_sum = 0.0;
  for (size_t k = 0; k < chunks.size(); ++k) (piece.at(chunks[k].tensor) ? piece_sum : whole_sum) += chunk_sq[k];
  auto total = [](const std::vector<torch::Tensor>& sq) { return sq.empty() ? 0.0 : torch::stack(sq).sum().item<double>(); };
  // Every rank takes part in the sum of the pieces.
  const double norm = std::sqrt(whole_sum + total(whole_sq) + sum_pieces(piece_sum + total(piece_sq)));
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& g : grads) g.mul_(scale);
  }
  return norm;
}

const std::vector<std::string>& schedule_kind_names() {
  static const std::vector<std::string> names = {"constant", "wsd", "cosine"};  // in ScheduleKind's order
  return names;
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  if (auto kind = enum_from_name<ScheduleKind>(schedule_kind_names(), name)) return *kind;
  throw std::invalid_argument("unknown schedule \"" + name + "\" (known: " + join(schedule_kind_names()) + ")");
}

std::string schedule_kind_name(ScheduleKind kind) { return enum_name(schedule_kind_names(), kind); }

Schedule Schedule::make(ScheduleKind kind, double lr, double min_lr_ratio, int64_t total_steps,
                        double warmup_pct, double decay_pct) {
  Schedule s;
  s.kind = kind;
  s.lr = lr;
  s.min_lr = lr * min_lr_ratio;
  s.total_steps = std::max<int64_t>(1, total_steps);
  s.warmup_steps = static_cast<int64_t>(std::floor(warmup_pct * static_cast<double>(s.total_steps)));
  s.decay_steps = kind == ScheduleKind::Wsd ? static_cast<int64_t>(std::floor(decay_pct * static_cast<double>(s.total_steps))) : 0;
  return s;
}

double Schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (kind == ScheduleKind::Constant) return lr;
  if (kind == ScheduleKind::Cosine) {
    int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
    double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  }
  // wsd
  int64_t decay_start = total_steps - decay_steps;
  if (decay_steps <= 0 || step < decay_start) return lr;
  double progress = static_cast<double>(step - decay_start + 1) / static_cast<double>(decay_steps);
  return lr + (min_lr - lr) * std::min(1.0, progress);
}

}  // namespace lt
