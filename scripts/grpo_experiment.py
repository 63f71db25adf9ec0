#!/usr/bin/env python3
"""GRPO against next-token LoRA on a verifiable task: addition of numbers up to 29 (docs/experiments.md).

For each seed:
  1. `lora/train`, phase 1: a small GPT (4 layers, d 128, byte tokens) learns sums from text ("12+17=29"
     lines: 750 of the 900 sums, shuffled into 20 documents) for 2,400 steps of 64 x 32 tokens
     (--phase1-steps), to partial accuracy on held-out sums; then its LoRA phase is GRPO on the prompts "12+17=" of the same 750 sums: 8 completions a
     prompt at temperature 0.7, cut at the first newline, rewarded 1 when the text equals the sum
     (exact_match), 800 steps of 64 completions (--lora-steps).
  2. `lora/train` without phase one from the same pre_lora_checkpoint: next-token LoRA on the reference
     answers of the same prompts ("12+17=" -> "29\n"), the same adapters (rank 8), lr (1e-3) and tokens
     (800 steps of 64 rows of 32).
  3. `eval --task` exact match (greedy, to the first newline) on the 150 held-out sums no run trained on:
     before (the pre_lora_checkpoint) and after each LoRA phase.
Writes OUT/results.md (the table), OUT/results.json (figures, times and the GRPO reward curves) and
prints the table. A re-run with the same OUT reuses its datasets; every job is run again.

  python3 scripts/grpo_experiment.py --out /tmp/grpo_exp [--seeds 1,2,3] [--jobs 3] [--binary build/lora_trainer]
      [--phase1-steps 2400] [--lora-steps 800]
"""
import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import time

ARCH = ["architecture/n_layers=4", "architecture/d_model=128", "architecture/n_heads=4", "architecture/block_size=32",
        "architecture/vocab_size=257", "runtime/threads=1", "logging/tensorboard=false"]
BATCH, G = 64, 8  # a step: BATCH rows of 32 tokens (phase 1), BATCH completions (BATCH / G prompts x G)


def die(msg):
    print("error: " + msg, file=sys.stderr)
    sys.exit(2)


def run(cmd, log):
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        die("%s failed (exit %d); its output is in %s" % (" ".join(cmd[:3]), p.returncode, log))
    return time.time() - t0


def printed(log, prefix):
    """The path a run printed after `prefix` (its final checkpoint, its metrics)."""
    with open(log) as f:
        for line in f:
            if prefix in line:
                return line.split(prefix, 1)[1].split()[0]
    die("%s does not say \"%s\"" % (log, prefix))


MAX_OPERAND = 29  # operands 0..29: 900 sums, 150 held out


def sums(rng, n, exclude=()):
    out, seen = [], set(exclude)
    while len(out) < n:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append((a, b))
    return out


def write_data(binary, out):
    """The text of phase 1, the GRPO prompts, the SFT records and the held-out task (fixed: seed 0)."""
    data = os.path.join(out, "data")
    if os.path.exists(os.path.join(data, "sft", "meta.json")):
        return data
    os.makedirs(os.path.join(out, "src", "text"), exist_ok=True)
    rng = random.Random(0)
    held = sums(rng, 150)
    train = sums(rng, (MAX_OPERAND + 1) ** 2 - 150, exclude=held)
    with open(os.path.join(out, "heldout.jsonl"), "w") as f:
        for a, b in held:
            f.write(json.dumps({"prompt": "%d+%d=" % (a, b), "answer": str(a + b), "max_tokens": 4}) + "\n")
    for d in range(20):  # phase 1's text: every training sum a line, in 20 documents, shuffled each
        lines = ["%d+%d=%d\n" % (a, b, a + b) for a, b in train]
        rng.shuffle(lines)
        with open(os.path.join(out, "src", "text", "doc%02d.txt" % d), "w") as f:
            f.write("".join(lines))
    with open(os.path.join(out, "src", "prompts.jsonl"), "w") as f:
        for a, b in train:
            f.write(json.dumps({"prompt": "%d+%d=" % (a, b), "answer": str(a + b)}) + "\n")
    with open(os.path.join(out, "src", "sft.jsonl"), "w") as f:
        for a, b in train:
            f.write(json.dumps({"prompt": "%d+%d=" % (a, b), "completion": "%d\n" % (a + b)}) + "\n")
    tok = [binary, "tokenize", "--data-dir", data, "--tokenizer", "byte", "--val-fraction", "0.05"]
    run(tok + ["--name", "sums", os.path.join(out, "src", "text")], os.path.join(out, "tokenize_text.log"))
    run(tok + ["--name", "prompts", "--format", "prompts", os.path.join(out, "src", "prompts.jsonl")],
        os.path.join(out, "tokenize_prompts.log"))
    run(tok + ["--name", "sft", "--format", "jsonl", os.path.join(out, "src", "sft.jsonl")],
        os.path.join(out, "tokenize_sft.log"))
    return data


def exact_match(binary, ckpt, task, log):
    run([binary, "eval", ckpt, "--task", task, "--json", "--tokenizer", "byte"], log)
    with open(log) as f:
        text = f.read()
    return json.loads(text[text.index("{"):])["tasks"]["heldout"]["exact_match"]


def train_events(run_dir):
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "train":
                out.append(e)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--binary", default="build/lora_trainer")
    ap.add_argument("--phase1-steps", type=int, default=2400, help="phase 1's steps of 64 x 32 tokens")
    ap.add_argument("--lora-steps", type=int, default=800, help="the LoRA phases' steps of 64 completions (or rows)")
    ap.add_argument("--jobs", type=int, default=3, help="seeds run at once (each job runs one thread)")
    a = ap.parse_args()
    if a.phase1_steps < 1 or a.lora_steps < 1 or a.jobs < 1:
        die("--phase1-steps, --lora-steps and --jobs must be positive")
    if not os.access(a.binary, os.X_OK):
        die(a.binary + " is not an executable: build it first (cmake --build build), or give --binary")
    seeds = [int(s) for s in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)
    data = write_data(a.binary, a.out)
    task = os.path.join(a.out, "heldout.jsonl")
    cfg = os.path.join(a.out, "lora.json")
    if not os.path.exists(cfg):
        run([a.binary, "configure", "lora/train", cfg], os.path.join(a.out, "configure.log"))
    common = ARCH + ["data/dir=" + data, "optimization/lora/rank=8", "optimization/lora/lr=0.001", "optimization/lr=0.003",
                     "optimization/lora/schedule=constant", "optimization/lora/warmup_pct=0",
                     "logging/report_interval=10", "logging/checkpoint_interval=100000",
                     "logging/validation_interval=100000", "training/validation=false", "eval/evaluations=[]"]
    lora_tokens = a.lora_steps * BATCH * 32

    def one_seed(seed):
        base = ["training/seed=%d" % seed]
        grpo = "grpo_s%d" % seed
        t_grpo = run([a.binary, "run", grpo, cfg, a.out] + common + base + [
            "training/pre_lora_tokens=[%d]" % (a.phase1_steps * BATCH * 32), "training/batch_size=%d" % BATCH,
            "training/per_device_batch_size=%d" % BATCH,
            'training/pre_lora_dataset=[[{"name":"sums","rate":1}]]',
            "training/post_lora_tokens=[%d]" % lora_tokens,
            'training/post_lora_dataset=[[{"name":"prompts","rate":1,"style":"prompts"}]]',
            "optimization/grpo/num_generations=%d" % G, "optimization/grpo/max_completion_length=4",
            "optimization/grpo/temperature=0.7",
            'optimization/grpo/rewards=[{"kind":"exact_match"}]', 'optimization/grpo/stop=["\\n"]',
            ], os.path.join(a.out, grpo + ".log"))
        final = printed(os.path.join(a.out, grpo + ".log"), "final checkpoint ")
        pre = os.path.join(os.path.dirname(os.path.dirname(final)), "pre_lora_checkpoint")
        sft = "sft_s%d" % seed
        t_sft = run([a.binary, "run", sft, cfg, a.out, "--restore", pre] + common + base + [
            "training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/batch_size=%d" % BATCH,
            "training/per_device_batch_size=%d" % BATCH, "training/post_lora_tokens=[%d]" % lora_tokens,
            'training/post_lora_dataset=[[{"name":"sft","rate":1,"style":"padded"}]]'], os.path.join(a.out, sft + ".log"))
        sft_final = printed(os.path.join(a.out, sft + ".log"), "final checkpoint ")
        before = exact_match(a.binary, pre, task, os.path.join(a.out, "eval_pre_s%d.log" % seed))
        after_grpo = exact_match(a.binary, final, task, os.path.join(a.out, "eval_grpo_s%d.log" % seed))
        after_sft = exact_match(a.binary, sft_final, task, os.path.join(a.out, "eval_sft_s%d.log" % seed))
        metrics = os.path.dirname(printed(os.path.join(a.out, grpo + ".log"), "metrics: "))
        ev = [e for e in train_events(metrics) if "reward" in e]
        curve = [(e["step"], e["reward"]) for e in ev]
        print("seed %d: exact match %.3f before, %.3f after GRPO, %.3f after next-token LoRA (%.0f s, %.0f s)" %
              (seed, before, after_grpo, after_sft, t_grpo, t_sft), flush=True)
        return {"seed": seed, "before": before, "grpo": after_grpo, "sft": after_sft,
                "grpo_seconds": t_grpo, "sft_seconds": t_sft, "reward_curve": curve,
                "rollout_tok_per_s": statistics.mean(e["rollout_tok_per_s"] for e in ev) if ev else None}

    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(one_seed, seeds))

    def ms(key):
        v = [r[key] for r in results]
        return "%.3f ± %.3f" % (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
    rows = ["| seed | before (phase 1) | after GRPO | after next-token LoRA |", "| --- | --- | --- | --- |"]
    for r in results:
        rows.append("| %d | %.3f | %.3f | %.3f |" % (r["seed"], r["before"], r["grpo"], r["sft"]))
    rows.append("| mean ± std | %s | %s | %s |" % (ms("before"), ms("grpo"), ms("sft")))
    table = "\n".join(rows) + "\n"
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(table)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"results": results, "phase1_steps": a.phase1_steps, "lora_steps": a.lora_steps, "G": G,
                   "batch": BATCH}, f, indent=1)
    print(table)


if __name__ == "__main__":
    main()
