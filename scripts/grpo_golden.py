#!/usr/bin/python3
"""The golden values of GRPO's loss (lora_trainer/recipes/grpo.hpp) from an independent plain-PyTorch
recomputation of TRL's GRPOTrainer formulas (trl/trainer/grpo_trainer.py, v1.9: advantages with
scale_rewards group/batch/none; the clipped per-token loss with epsilon / epsilon_high; the k3 KL
penalty with beta; the loss types grpo, dr_grpo and dapo; log-probabilities of logits / temperature),
on one process without gradient accumulation (a step = the whole batch of rollouts).

Writes tests/data/golden/grpo.json: the inputs (logits, targets, mask, rewards, the reference's
log-probabilities) and, for each loss type, beta and iteration, the loss and its gradient with respect
to the logits; tests/recipes/test_grpo.cpp recomputes them. Run with Debian's python3-torch:
    /usr/bin/python3 scripts/grpo_golden.py [OUT.json]
"""
import json
import math
import sys

import torch

torch.manual_seed(20261129)
B, T, V = 4, 6, 7           # one group of 4 completions, 6 positions, 7 ids
TEMPERATURE = 0.7
EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_LEN = 8


def advantages(rewards, group, scaling):
    g = rewards.view(-1, group)
    mean = torch.nanmean(g, dim=1, keepdim=True)
    adv = g - mean

    def nanstd(x):  # Bessel-corrected over the valid entries; NaN with fewer than two
        ok = ~torch.isnan(x)
        n = ok.sum(dim=-1, keepdim=True).double()
        m = torch.nansum(x, dim=-1, keepdim=True) / n
        var = torch.nansum((x - m) ** 2, dim=-1, keepdim=True) / (n - 1)
        return torch.where(n > 1, var.sqrt(), torch.full_like(n, float("nan")))

    if scaling == "group":
        adv = adv / (nanstd(g) + 1e-4)
    elif scaling == "batch":
        adv = adv / (nanstd(rewards.view(1, -1)) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0).reshape(-1)


def logps_of(logits, targets):
    z = logits / TEMPERATURE
    return torch.log_softmax(z, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def loss_of(logits, targets, mask, adv, old, ref, loss_type, beta):
    logp = logps_of(logits, targets)
    if old is None:
        old = logp.detach()
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    per = -torch.min(ratio * adv.unsqueeze(1), clipped * adv.unsqueeze(1))
    if beta != 0:
        d = ref - logp
        per = per + beta * (torch.exp(d) - d - 1)
    if loss_type == "grpo":
        return ((per * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per * mask).sum() / (per.size(0) * MAX_LEN)
    if loss_type == "dapo":
        return (per * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(loss_type)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/golden/grpo.json"
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, float("nan"), 2.0, 0.25], dtype=torch.float64)
    adv_cases = {s: advantages(rewards, 4, s).tolist() for s in ("group", "batch", "none")}

    logits1 = torch.randn(B, T, V) * 2.0
    logits2 = logits1 + torch.randn(B, T, V) * 0.6  # the policy after a step: ratios off 1, some clipped
    ref_logits = logits1 + torch.randn(B, T, V) * 0.3
    targets = torch.randint(0, V, (B, T))
    lengths = [6, 3, 1, 4]  # completion tokens of each row (the rest padding)
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    targets = torch.where(mask.bool(), targets, torch.full_like(targets, -1))
    step_rewards = torch.tensor([1.0, 0.0, 0.0, 0.5], dtype=torch.float64)
    adv = advantages(step_rewards, 4, "group").float()
    ref = logps_of(ref_logits, targets).detach()
    old = logps_of(logits1, targets).detach()  # the second iteration's old policy: the first's

    cases = []
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        for beta in (0.0, 0.04):
            for iteration in (1, 2):
                logits = (logits1 if iteration == 1 else logits2).clone().requires_grad_(True)
                loss = loss_of(logits, targets, mask, adv, None if iteration == 1 else old, ref, loss_type, beta)
                loss.backward()
                cases.append({"loss_type": loss_type, "beta": beta, "iteration": iteration, "loss": loss.item(),
                              "grad": logits.grad.tolist()})

    golden = {
        "made_by": "scripts/grpo_golden.py, torch " + torch.__version__,
        "temperature": TEMPERATURE, "epsilon": EPS_LOW, "epsilon_high": EPS_HIGH, "max_completion_length": MAX_LEN,
        "advantages": {"rewards": [None if math.isnan(r) else r for r in rewards.tolist()], "group_size": 4,
                       "expected": adv_cases},
        "logits1": logits1.tolist(), "logits2": logits2.tolist(), "targets": targets.tolist(), "mask": mask.tolist(),
        "step_rewards": step_rewards.tolist(), "ref_logps": ref.tolist(), "cases": cases,
    }
    with open(out_path, "w") as f:
        json.dump(golden, f)
        f.write("\n")
    print("wrote", out_path, "with", len(cases), "loss cases")


if __name__ == "__main__":
    main()
