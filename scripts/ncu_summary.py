#!/usr/bin/env python3
"""Where a lora_trainer step's GPU time goes, from Nsight Compute's per-kernel durations.

scripts/profile_kernels.sh runs `lora_trainer bench ... --cuda-profile PHASE --steps 1` under
`ncu --profile-from-start off --metrics gpu__time_duration.sum --csv`: the bench brackets that
phase's timed step with cudaProfilerStart/Stop, so the CSV lists exactly one step's kernels. This
sums their durations by kind (matrix products, attention, the loss, elementwise, reductions,
optimizer, copies), prints the largest kernels, and compares the kernels' total with the step's
time in an unprofiled bench run (BENCH_JSON): the difference is time the GPU waited for the host.

    python3 scripts/ncu_summary.py NCU_CSV [--bench BENCH_JSON --phase full|lora] [--top 25] [--out JSON]
"""
import argparse
import collections
import csv
import json
import re
import sys

UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}

# (kind, pattern on the kernel name), first match wins.
KINDS = [
    ("loss (fused)", r"lt::cuda_kernels|forward_kernel<|backward_kernel<"),
    ("loss/softmax (LibTorch)", r"softmax|SoftMax|nll_loss|NLLLoss|cross_entropy"),
    ("attention", r"flash|fmha|attention|efficient_attention|mem_eff"),
    ("matrix products", r"gemm|sm90_xmma|sm80_xmma|cutlass|cublas|nvjet|s16816|s1688|wgmma|Kernel2"),
    ("optimizer", r"adam|Adam|fused_adamw|multi_tensor_apply|foreach"),
    ("layer/rms norm", r"layer_norm|LayerNorm|rms_norm|RowwiseMoments|compute_gI|GammaBeta|cuComputePartGradGammaBeta"),
    ("embedding", r"embedding|Embedding|indexSelect|index_select|index_put|indexing_backward|sort|radix|segment"),
    ("reductions", r"reduce_kernel|Reduce|reduce"),
    ("copies/casts", r"copy|Copy|cat_|CatArray|to_copy|direct_copy"),
    ("elementwise", r"elementwise|vectorized|unrolled|gelu|GeluCUDA|silu|mul|add|fill"),
]


def kind_of(name):
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


def read_durations(path):
    """[(kernel name, ns)] in launch order, from ncu's --csv output (details or raw page)."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own messages before the CSV
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"ncu_summary: no CSV rows in {path} (did ncu profile any kernel? see its log)")
    head = rows[0]
    out = []
    if "Metric Name" in head:  # details page: one row per (kernel, metric)
        i_id, i_name = head.index("ID"), head.index("Kernel Name")
        i_metric, i_unit, i_value = head.index("Metric Name"), head.index("Metric Unit"), head.index("Metric Value")
        for r in rows[1:]:
            if len(r) > i_value and r[i_metric] == "gpu__time_duration.sum":
                out.append((int(r[i_id]), r[i_name], float(r[i_value].replace(",", "")) * UNIT_NS.get(r[i_unit], 1.0)))
    else:  # raw page: one row per kernel, the second row holds the units
        i_id, i_name, i_value = head.index("ID"), head.index("Kernel Name"), head.index("gpu__time_duration.sum")
        unit = UNIT_NS.get(rows[1][i_value], 1.0) if len(rows) > 1 else 1.0
        for r in rows[2:]:
            if len(r) > i_value and r[i_value]:
                out.append((int(r[i_id]), r[i_name], float(r[i_value].replace(",", "")) * unit))
    out.sort()
    return [(name, ns) for _, name, ns in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--bench", help="an unprofiled bench's JSON: its median step time is compared with the kernels'")
    ap.add_argument("--phase", default="full", choices=["full", "lora"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args()

    kernels = read_durations(a.csv)
    total = sum(ns for _, ns in kernels)
    by_kind = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, ns in kernels:
        k = by_kind[kind_of(name)]
        k[0] += ns
        k[1] += 1
        n = by_name[name]
        n[0] += ns
        n[1] += 1

    step_ms = None
    if a.bench:
        with open(a.bench) as f:
            bench = json.load(f)
        for ph in bench.get("phases", []):
            if ph.get("phase") == a.phase:
                step_ms = 1000 * ph["step_s_median"]

    print(f"{a.phase} phase: {len(kernels)} kernels, {total / 1e6:.2f} ms of GPU time in one step")
    if step_ms:
        print(f"unprofiled step (median): {step_ms:.2f} ms; kernels {100 * total / 1e6 / step_ms:.1f}% of it, "
              f"the GPU idle for about {max(0.0, step_ms - total / 1e6):.2f} ms")
    print(f"\n{'kind':26s} {'ms':>9s} {'share':>7s} {'kernels':>8s}")
    for kind, (ns, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind:26s} {ns / 1e6:9.2f} {100 * ns / total:6.1f}% {count:8d}")
    print(f"\nthe {a.top} kernels with the most time (name cut at 110 characters)")
    print(f"{'ms':>8s} {'calls':>6s}  name")
    for name, (ns, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{ns / 1e6:8.2f} {count:6d}  {name[:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"phase": a.phase, "kernels": len(kernels), "kernel_ms": total / 1e6, "step_ms": step_ms,
                       "by_kind": {k: {"ms": v[0] / 1e6, "kernels": v[1]} for k, v in by_kind.items()},
                       "top": [{"name": n, "ms": v[0] / 1e6, "calls": v[1]}
                               for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]]}, f, indent=2)


if __name__ == "__main__":
    main()
