#!/usr/bin/env python3
"""Where a training step's GPU time goes: runs scripts/reference_gpt.py's model (the same GPT and
phases as lora_trainer, as plain PyTorch) under torch.profiler on CUDA and prints the kernels that
take the most GPU time, per phase. A tool for performance work on a GPU machine, not a benchmark.

Usage: scripts/profile_cuda.py BENCH_JSON [--steps N] [--top K]
BENCH_JSON: what `lora_trainer bench CONFIG --out BENCH_JSON` wrote (its resolved config is used;
the weights are random).
"""
import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_gpt as ref  # noqa: E402


def random_params(cfg, device):
    a = cfg["architecture"]
    V, T, C, L = a["vocab_size"], a["block_size"], a["d_model"], a["n_layers"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(L):
        h = f"h.{i}."
        shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                       h + "attn.c_attn.weight": (3 * C, C), h + "attn.c_attn.bias": (3 * C,),
                       h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                       h + "mlp.c_fc.weight": (4 * C, C), h + "mlp.c_fc.bias": (4 * C,),
                       h + "mlp.c_proj.weight": (C, 4 * C), h + "mlp.c_proj.bias": (C,)})
    return {k: (torch.randn(s, device=device) * 0.02).requires_grad_(True) for k, s in shapes.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    cfg = json.load(open(args.bench_json))["resolved_config"]
    ref.bf16, ref.device_type = True, "cuda"
    params = random_params(cfg, "cuda")
    model = ref.GPT(cfg, params, sdpa=True)
    phases = [("full", list(params.values()), cfg["optimization"]["lr"], cfg["optimization"]["weight_decay"])]
    for name, plist, lr, wd in phases:
        step = ref.make_step(model, plist, cfg, lr, wd, "cuda", False)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        print(f"\n=== {name}: GPU time by kernel over {args.steps} steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))


if __name__ == "__main__":
    main()
