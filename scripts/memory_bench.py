#!/usr/bin/env python3
"""The memory plan beside measured peaks: each job kind and storage on one small Llama.

  python3 scripts/memory_bench.py [--work /tmp/lt_memory] [--out memory.json] [-- key=value ...]

Runs, each as its own process, 2 steps of 8 x 256 tokens of a Llama (8 layers, d_model 256, d_ff
704, 8 heads, 4 key/value heads; 6.0M parameters; byte tokens) as
  full        `train`: every parameter (f32 weights, gradients, AdamW moments)
  full_ckpt   the same with training/activation_checkpointing=true
  lora        lora/train without phase one from full's checkpoint: a bf16 base, adapters of rank 8
  lora_ckpt   the same, checkpointed
  qlora       the same with optimization/lora/quantize_base=nf4
  sharded     lora on 2 ranks (--nproc 2) with distributed/shard_params=lora
  grpo        lora with GRPO on prompts (64-byte prompts, 8 completions of up to 128 tokens a step,
              all generated at once: the rollouts' KV cache, then unfused log-probabilities)
  full_128k   full with Llama 3's vocabulary of 128,256 (an untied head; its logits are 1 GB in f32)
  lora_128k   lora from full_128k's checkpoint: the frozen head's loss chunked (runtime/loss=auto), and
  lora_128k_whole  the same with the logits whole (runtime/loss=fused)
and prints, from each run's `memory` event (metrics.jsonl), its peak allocated memory (the peak
resident set less the mapped files' pages: anonymous memory) beside the plan's peak for a rank, and
writes them to --out. Record the table in docs/memory.md with the CPU model (lscpu).
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--work", default="/tmp/lt_memory", help="working directory")
    ap.add_argument("--out", default="memory.json", help="where to write the figures (JSON)")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    ap.add_argument("overrides", nargs="*", help="key=value settings for every job (after --)")
    a = ap.parse_args()
    B = a.binary
    if not os.access(B, os.X_OK):
        sys.exit(f"memory_bench.py: {B} is not an executable; build it first (scripts/setup.sh) or pass --binary")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    data = os.path.join(a.work, "data")
    subprocess.run([B, "tokenize", "/usr/share/common-licenses", "--name", "text", "--data-dir", data, "--tokenizer", "byte"],
                   check=True, stdout=subprocess.DEVNULL)
    arch = ["architecture/family=llama", "architecture/d_model=256", "architecture/n_layers=8",
            "architecture/n_heads=8", "architecture/n_kv_heads=4", "architecture/d_ff=704", "architecture/block_size=256",
            "architecture/activation=silu", "architecture/tie_embeddings=false"]
    common = [f"data/dir={json.dumps(data)}", "logging/report_interval=1000", "logging/checkpoint_interval=1000",
              "training/validation=false", "training/batch_size=8"] + a.overrides
    # Prompts for the GRPO form: arithmetic questions of 64 bytes, the answer in each record.
    prompts = os.path.join(a.work, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Question {i:3d}: what is {i} + {i % 7}? Answer with the number.".ljust(64),
                                "answer": str(i + i % 7)}) + "\n")
    subprocess.run([B, "tokenize", prompts, "--format", "prompts", "--name", "prompts", "--data-dir", data, "--tokenizer", "byte"],
                   check=True, stdout=subprocess.DEVNULL)
    def configure(name, vocab):
        full_cfg, lora_cfg = os.path.join(a.work, f"full{name}.json"), os.path.join(a.work, f"lora{name}.json")
        v = [f"architecture/vocab_size={vocab}"]
        subprocess.run([B, "configure", "train", full_cfg] + arch + v + common +
                       ["training/tokens=4096", 'training/dataset=[{"name":"text","rate":1}]'], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([B, "configure", "lora/train", lora_cfg] + arch + v + common +
                       ["training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", "training/post_lora_tokens=[4096]",
                        'training/post_lora_dataset=[[{"name":"text","rate":1}]]', "optimization/lora/rank=8"],
                       check=True, stdout=subprocess.DEVNULL)
        return full_cfg, lora_cfg
    full_cfg, lora_cfg = configure("", 257)
    full_big, lora_big = configure("_128k", 128256)
    out = os.path.join(a.work, "out")
    base = os.path.join(out, "checkpoints", "general", "default", "full", "final", "4096")
    base_big = os.path.join(out, "checkpoints", "general", "default", "full_128k", "final", "4096")
    variants = [("full", full_cfg, []), ("full_ckpt", full_cfg, ["training/activation_checkpointing=true"]),
                ("lora", lora_cfg, ["--restore", base]),
                ("lora_ckpt", lora_cfg, ["--restore", base, "training/activation_checkpointing=true"]),
                ("qlora", lora_cfg, ["--restore", base, "optimization/lora/quantize_base=nf4"]),
                ("sharded", lora_cfg, ["--restore", base, "--nproc", "2", "distributed/shard_params=lora"]),
                ("grpo", lora_cfg, ["--restore", base, 'training/post_lora_dataset=[[{"name":"prompts","rate":1,"style":"prompts"}]]',
                                    "optimization/grpo/num_generations=8", "optimization/grpo/max_completion_length=128",
                                    'optimization/grpo/rewards=[{"kind":"length"}]']),
                ("full_128k", full_big, []),
                ("lora_128k", lora_big, ["--restore", base_big]),
                ("lora_128k_whole", lora_big, ["--restore", base_big, "runtime/loss=fused"])]
    r = {"cpu": platform.processor() or "", "runs": {}}
    try:
        r["cpu"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        pass
    print(f"memory plan beside measured peaks (allocated: anonymous memory), {r['cpu']}")
    for name, cfg, extra in variants:
        log = os.path.join(a.work, name + ".log")
        with open(log, "w") as f:
            rc = subprocess.run([B, "run", name, cfg, out] + extra, stdout=f, stderr=subprocess.STDOUT).returncode
        metrics = os.path.join(out, "runs", "general", "default", name, "metrics.jsonl")
        events = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
        m = next((e for e in events if e.get("event") == "memory"), None)
        if rc != 0 or not m:
            sys.exit(f"memory_bench.py: {name} failed (exit {rc}); see {log}")
        r["runs"][name] = m
        print(f"  {name:15s} peak {m['peak_allocated'] / 1e6:7.0f} MB, plan {m['plan_host'] / 1e6:7.0f} MB "
              f"({100 * (m['plan_host'] / m['peak_allocated'] - 1):+.0f}%)")
    with open(a.out, "w") as f:
        json.dump(r, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
