#!/usr/bin/env python3
"""Fits the memory plan's activation coefficients on this machine and this build's LibTorch.

  python3 scripts/fit_activations.py [--binary build/lora_trainer] [--work /tmp/lt_fit] [--out fit.json]
                                     [--families llama,gpt2] [--precisions bf16,f32]

What a block keeps for its backward depends on LibTorch's autograd (2.x saves fewer operands than
1.13: none whose partner needs no gradient) and on whether the block's weights train (phase 1) or are
frozen (the LoRA phase, where LibTorch 2.x keeps still less). The plan (lora_trainer/training/
memory_plan.cpp, block_activations) holds one row per LibTorch generation, family, precision and phase:
bytes a token keeps per unit of d_model and of d_ff in a block, and bytes per attention weight (row,
head, query, key) where attention is not fused. This script measures them: for each family and
precision it runs, as separate processes, 2 steps of `train` (every parameter) over several shapes
(d_model, d_ff, block_size) and 4 and 8 layers, then `lora/train` from each run's checkpoint (rank 8 on
every linear weight), takes each run's measured peak (the `memory` event: anonymous memory) less the
plan's other items (`lora_trainer plan --json`), and fits by least squares

    peak - other items - 2 x (f32 residual stream) = (layers + 1) x (N (a d_model + b d_ff) + g B H T^2)

(N = B x T tokens a micro-batch), without a constant (the plan has none: the runtime is measured) and
weighted by 1 / peak, so that the plan's relative errors are the least. It prints each row and the
range of the plan's errors over its runs, and writes the rows and the runs to --out. Copy the rows
into kActivationRows (memory_plan.cpp) and the table of docs/memory.md.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (d_model, heads, d_ff, block_size): d_model, d_ff and T each vary against the first.
SHAPES = [(256, 8, 704, 256), (512, 8, 1408, 256), (256, 8, 2048, 256), (256, 8, 704, 128), (384, 6, 1024, 128)]
LAYERS = [4, 8]
BATCH = 8


def solve(rows, ys):
    """Least squares by the normal equations (a few unknowns; no numpy needed)."""
    n = len(rows[0])
    A = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(A[r][c]))
        A[c], A[p] = A[p], A[c]
        for r in range(n):
            if r != c:
                f = A[r][c] / A[c][c]
                A[r] = [x - f * y for x, y in zip(A[r], A[c])]
    return [A[i][n] / A[i][i] for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    ap.add_argument("--work", default="/tmp/lt_fit", help="working directory (deleted first)")
    ap.add_argument("--out", default="fit.json", help="where to write the rows and the runs (JSON)")
    ap.add_argument("--families", default="llama,gpt2")
    ap.add_argument("--precisions", default="bf16,f32")
    a = ap.parse_args()
    B = a.binary
    if not os.access(B, os.X_OK):
        sys.exit(f"fit_activations.py: {B} is not an executable; build it first (scripts/setup.sh) or pass --binary")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    data = os.path.join(a.work, "data")
    subprocess.run([B, "tokenize", "/usr/share/common-licenses", "--name", "text", "--data-dir", data, "--tokenizer", "byte"],
                   check=True, stdout=subprocess.DEVNULL)
    v = subprocess.run([B, "--version"], capture_output=True, text=True)
    version = v.stdout.strip() if v.returncode == 0 else B + " (a build without --version)"
    result = {"binary": version, "rows": {}, "runs": []}
    print(f"fitting block activations: {version}")

    def run(name, args, log):
        with open(log, "w") as f:
            rc = subprocess.run([B] + args, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            sys.exit(f"fit_activations.py: {name} failed (exit {rc}); see {log}")

    def measured(out, name):
        for line in open(os.path.join(out, "runs", "general", "default", name, "metrics.jsonl")):
            e = json.loads(line)
            if e.get("event") == "memory":
                return e["peak_allocated"]
        sys.exit(f"fit_activations.py: {name} wrote no memory event")

    def planned(args, phase_word):
        p = subprocess.run([B, "plan"] + args + ["--json"], capture_output=True, text=True)
        if p.returncode not in (0, 5):
            sys.exit(f"fit_activations.py: plan {' '.join(args)} failed:\n{p.stdout}{p.stderr}")
        phase = next(ph for ph in json.loads(p.stdout)["phases"] if phase_word in ph["phase"])
        act = next(i["host"] for i in phase["items"] if i["what"].startswith("activations"))
        return phase["host"] - act

    for family in a.families.split(","):
        for precision in a.precisions.split(","):
            samples = {"full": [], "lora": []}
            for (C, H, F, T) in SHAPES:
                for L in LAYERS:
                    tag = f"{family}_{precision}_c{C}_f{F}_t{T}_l{L}"
                    arch = [f"architecture/family={family}", "architecture/vocab_size=257", f"architecture/d_model={C}",
                            f"architecture/n_layers={L}", f"architecture/n_heads={H}", f"architecture/d_ff={F}",
                            f"architecture/block_size={T}", f"runtime/precision={precision}",
                            f"data/dir={json.dumps(data)}", "logging/report_interval=1000",
                            "logging/checkpoint_interval=1000", "training/validation=false", f"training/batch_size={BATCH}"]
                    if family == "llama":
                        arch += ["architecture/n_kv_heads=" + str(H // 2), "architecture/activation=silu",
                                 "architecture/tie_embeddings=false"]
                    tokens = 2 * BATCH * T
                    full_cfg, lora_cfg = os.path.join(a.work, tag + "_full.json"), os.path.join(a.work, tag + "_lora.json")
                    subprocess.run([B, "configure", "train", full_cfg] + arch +
                                   [f"training/tokens={tokens}", 'training/dataset=[{"name":"text","rate":1}]'],
                                   check=True, stdout=subprocess.DEVNULL)
                    subprocess.run([B, "configure", "lora/train", lora_cfg] + arch +
                                   ["training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]",
                                    f"training/post_lora_tokens=[{tokens}]",
                                    'training/post_lora_dataset=[[{"name":"text","rate":1}]]', "optimization/lora/rank=8"],
                                   check=True, stdout=subprocess.DEVNULL)
                    out = os.path.join(a.work, "out")
                    run(tag + "_full", ["run", tag + "_full", full_cfg, out], os.path.join(a.work, tag + "_full.log"))
                    base = os.path.join(out, "checkpoints", "general", "default", tag + "_full", "final", str(tokens))
                    run(tag + "_lora", ["run", tag + "_lora", lora_cfg, out, "--restore", base],
                        os.path.join(a.work, tag + "_lora.log"))
                    N = BATCH * T
                    x = [(L + 1) * N * C, (L + 1) * N * F, (L + 1) * BATCH * H * T * T]
                    stream2 = 2 * 4.0 * N * C
                    for phase, name, args, word in (("full", tag + "_full", [full_cfg], "phase 1"),
                                                    ("lora", tag + "_lora", [lora_cfg, "--restore", base], "LoRA")):
                        peak = measured(out, name)
                        other = planned(args, word)
                        samples[phase].append((x, peak - other - stream2, peak, other, tag))
                    shutil.rmtree(os.path.join(out, "checkpoints", "general", "default", tag + "_full"), ignore_errors=True)
            for phase, rows in samples.items():
                coef = solve([[v / peak for v in x] for x, y, peak, other, tag in rows],
                             [y / peak for x, y, peak, other, tag in rows])
                key = f"{family} {precision} {phase}"
                result["rows"][key] = {"per_d_model": coef[0], "per_d_ff": coef[1], "attention": coef[2]}
                errs = []
                for x, y, peak, other, tag in rows:
                    plan = peak - y + sum(c * v for c, v in zip(coef, x))
                    errs.append(plan / peak - 1)
                    result["runs"].append({"row": key, "run": tag, "peak": peak, "plan": plan, "x": x, "y": y})
                print(f"  {key:18s} per d_model {coef[0]:6.1f}  per d_ff {coef[1]:6.1f}  attention {coef[2]:5.2f}; "
                      f"the plan {100 * min(errs):+.1f}% to {100 * max(errs):+.1f}% of the peaks", flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
