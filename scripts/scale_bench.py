#!/usr/bin/env python3
"""The scale benchmark: what a real-size base costs, beside its bf16 size.

  python3 scripts/scale_bench.py [--shape tinyllama-1.1b] [--work /tmp/lt_scale] [--out scale.json]

On a synthetic Hugging Face model of the shape (scripts/make_hf_model.py, random bf16 weights; made once
under --work), it runs and measures, each as its own process (peak RSS from the kernel's rusage of that
process, wall time from here):
  read      reading the weight files once (the floor a load is compared with)
  import    `import-hf` (the source's dtype kept): peak RSS, time, checkpoint size
  lora      `run --restore HF_DIR`, a lora/train job without phase one: --steps steps of
            --batch rows x --block tokens: peak RSS, load time, step time, LoRA checkpoint size, the
            frozen base's bytes as stored (the transition event's frozen_bytes), and the run's own
            `memory` event: its peak allocated (anonymous) memory beside its memory plan's peak
  resume    `restore` from that job's first checkpoint (reads the base it refers to and checks its
            digest) to the end: peak RSS, time
  export    `export --format hf` of the job's final checkpoint (adapters merged into the bf16 base, written
            in bf16): peak RSS, time, size
  copies    the same job with logging/save_frozen_base=true: its checkpoint size (today's form before
            the base was referred to)
and prints them beside the base's bf16 bytes, and writes them as JSON to --out. On a CUDA build with a
GPU, pass runtime/device=cuda after `--` to run the jobs there: the LoRA job's peak GPU memory (its step
lines' gpu_peak_gb) is then reported too. --skip import,copies,export,resume leaves those stages out (a GPU run
needs none of the first three: they run on the CPU, and the copies' size does not depend on the
device; without resume, the load is timed once). --nproc N
runs the `lora` stage as N data-parallel ranks on this machine (`run --nproc N`), and reports each rank's
peak RSS as the launcher prints it (with `-- distributed/shard_params=lora`: the base sharded). Record the
figures in docs/performance.md with the CPU model (lscpu). --cold (root) drops the page cache before the
read and before each stage, so that both read the files from the disk.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(cmd, log):
    """Runs cmd, its output to `log`; returns (seconds, peak RSS in bytes, exit status)."""
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    return time.time() - t0, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def dir_bytes(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def grep(log, prefix):
    with open(log) as f:
        return [line.rstrip("\n") for line in f if line.startswith(prefix)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--shape", default="tinyllama-1.1b", help="make_hf_model.py's --shape (default tinyllama-1.1b)")
    ap.add_argument("--work", default="/tmp/lt_scale", help="working directory (the model is made once there)")
    ap.add_argument("--out", default="scale.json", help="where to write the figures (JSON)")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--skip", default="", help="stages to leave out, comma-separated: import, copies, export, resume")
    ap.add_argument("--nproc", type=int, default=1, help="ranks of the lora stage (run --nproc N; default 1)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before the read and before each job (root: writes /proc/sys/vm/drop_caches), "
                         "so that both read the files from the disk")
    ap.add_argument("overrides", nargs="*", help="key=value settings for the jobs (after --)")
    a = ap.parse_args()
    B = a.binary
    if not os.access(B, os.X_OK):
        sys.exit(f"scale_bench.py: {B} is not an executable; build it first (scripts/setup.sh) or pass --binary")
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, a.shape)
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_hf_model.py"), "--shape", a.shape, model], check=True)
    weights = [os.path.join(model, f) for f in sorted(os.listdir(model)) if f.endswith(".safetensors")]
    base = sum(os.path.getsize(f) for f in weights)
    data = os.path.join(a.work, "data")
    if not os.path.exists(os.path.join(data, "text", "meta.json")):
        subprocess.run([B, "tokenize", "/usr/share/common-licenses", "--name", "text", "--data-dir", data, "--tokenizer", "byte"],
                       check=True, stdout=subprocess.DEVNULL)
    cfg = os.path.join(a.work, "lora.json")
    subprocess.run([B, "configure", "lora/train", cfg, "--force"], check=True, stdout=subprocess.DEVNULL)
    tokens = a.steps * a.batch * a.block
    job = ["training/pre_lora_tokens=[]", "training/pre_lora_dataset=[]", f"training/post_lora_tokens=[{tokens}]",
           'training/post_lora_dataset=[[{"name":"text","rate":1,"style":"pmd"}]]', f"data/dir={data}",
           f"architecture/block_size={a.block}", f"training/batch_size={a.batch}", "training/validation_steps=2",
           "logging/checkpoint_interval=1", "logging/report_interval=1"] + a.overrides
    out = os.path.join(a.work, "out")
    shutil.rmtree(out, ignore_errors=True)
    logs = os.path.join(a.work, "logs")
    os.makedirs(logs, exist_ok=True)
    r = {"shape": a.shape, "base_bf16_bytes": base, "cpu": platform.processor() or "", "steps": a.steps,
         "rows": a.batch, "block": a.block}
    try:
        r["cpu"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        pass

    def cold():
        if not a.cold:
            return
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            sys.exit(f"scale_bench.py: --cold needs to write /proc/sys/vm/drop_caches (root): {e}")

    cold()
    t0 = time.time()
    for f in weights:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    r["read_s"] = time.time() - t0

    skip = set(x for x in a.skip.split(",") if x)
    stages = {"import", "copies", "export", "resume"}
    if skip - stages:
        sys.exit(f"scale_bench.py: --skip takes {', '.join(sorted(stages))}, not {', '.join(sorted(skip - stages))}")
    if "import" not in skip:
        imported = os.path.join(a.work, "imported")
        shutil.rmtree(imported, ignore_errors=True)
        cold()
        s, rss, rc = measure([B, "import-hf", model, imported], os.path.join(logs, "import.log"))
        r["import"] = {"seconds": s, "peak_rss": rss, "checkpoint_bytes": dir_bytes(imported), "exit": rc}

    ranks = ["--nproc", str(a.nproc)] if a.nproc > 1 else []
    cold()
    s, rss, rc = measure([B, "run", "lora", cfg, out, "--restore", model] + ranks + job, os.path.join(logs, "lora.log"))
    jobdir = os.path.join(out, "checkpoints", "general", "default", "lora")
    loaded = grep(os.path.join(logs, "lora.log"), "loaded ")
    steps = [json.loads(l) for l in open(os.path.join(out, "runs", "general", "default", "lora", "metrics.jsonl"))]
    step_s = [a.batch * a.block / e["tok_per_s"] for e in steps if e.get("event") == "train" and e.get("tok_per_s")]
    gpu = [e["gpu_peak_gb"] for e in steps if e.get("event") == "train" and "gpu_peak_gb" in e]
    transition = next((e for e in steps if e.get("event") == "transition"), {})
    memory = next((e for e in steps if e.get("event") == "memory"), {})  # rank 0's measured peak beside its plan
    r["lora"] = {"frozen_bytes": transition.get("frozen_bytes"), "frozen_params": transition.get("frozen_params"),
                 "quantized_params": transition.get("quantized_params"),
                 "peak_allocated": memory.get("peak_allocated"), "plan_host": memory.get("plan_host"),
                 "mapped_files": memory.get("mapped_files"),
                 "seconds": s, "peak_rss": rss, "exit": rc, "load_line": loaded[0] if loaded else "",
                 "load_s": float(loaded[0].split(" in ")[1].split(" s")[0]) if loaded else None,
                 "step_s": step_s, "gpu_peak_bytes": max(gpu) * 1e9 if gpu else None, "checkpoint_bytes": dir_bytes(os.path.join(jobdir, "final", str(tokens)))}
    if a.nproc > 1:  # the launcher's own RSS says nothing: each rank's, as it prints them ("0: 1.23 GB, 1: ...")
        peaks = grep(os.path.join(logs, "lora.log"), "peak resident memory per rank: ")
        r["lora"]["ranks"] = a.nproc
        r["lora"]["rank_peak_rss"] = [float(x.split(": ")[1].split(" GB")[0]) * 1e9 for x in peaks[0].split("rank: ")[1].split(", ")] if peaks else []
        if r["lora"]["rank_peak_rss"]:
            r["lora"]["peak_rss"] = max(r["lora"]["rank_peak_rss"])

    first = f"ntoks/{a.batch * a.block}"
    if "resume" not in skip:
        cold()
        s, rss, rc = measure([B, "restore", "resumed", os.path.join(jobdir, first), out], os.path.join(logs, "resume.log"))
        r["resume"] = {"seconds": s, "peak_rss": rss, "exit": rc,
                       "base_line": (grep(os.path.join(logs, "resume.log"), "frozen base of") or [""])[0]}

    if "export" not in skip:
        hf = os.path.join(a.work, "exported_hf")
        shutil.rmtree(hf, ignore_errors=True)
        cold()
        s, rss, rc = measure([B, "export", "--format", "hf", os.path.join(jobdir, "final", str(tokens)), hf],
                             os.path.join(logs, "export.log"))
        r["export"] = {"seconds": s, "peak_rss": rss, "exit": rc, "bytes": dir_bytes(hf),
                       "line": (grep(os.path.join(logs, "export.log"), "exported ") or [""])[0]}

    if "copies" not in skip:
        cold()
        s, rss, rc = measure([B, "run", "copies", cfg, out, "--restore", model, "logging/save_frozen_base=true"] + job,
                             os.path.join(logs, "copies.log"))
        r["copies"] = {"seconds": s, "peak_rss": rss, "exit": rc, "checkpoint_bytes": dir_bytes(
            os.path.join(out, "checkpoints", "general", "default", "copies", "final", str(tokens)))}

    gb = lambda b: f"{b / 1e9:.2f} GB"
    x = lambda b: f"{b / base:.2f}x"
    print(f"scale benchmark: {a.shape}, base {gb(base)} of bf16 ({len(weights)} file(s)); {r['cpu']}")
    print(f"  reading the files once      {r['read_s']:.1f} s")
    if "import" in r:
        print(f"  import-hf                   {r['import']['seconds']:.1f} s, peak RSS {gb(r['import']['peak_rss'])} "
              f"({x(r['import']['peak_rss'])}), checkpoint {gb(r['import']['checkpoint_bytes'])}")
    L = r["lora"]
    print(f"  LoRA job from the directory {L['seconds']:.1f} s, peak RSS {gb(L['peak_rss'])} ({x(L['peak_rss'])}), load "
          f"{L['load_s']} s, steps {', '.join(f'{t:.1f}' for t in L['step_s'])} s ({a.batch} x {a.block} tokens), "
          f"LoRA checkpoint {L['checkpoint_bytes'] / 1e6:.1f} MB ({100 * L['checkpoint_bytes'] / base:.1f}% of the base)"
          + (f", peak GPU memory {gb(L['gpu_peak_bytes'])} ({x(L['gpu_peak_bytes'])})" if L["gpu_peak_bytes"] else ""))
    if L.get("peak_allocated"):
        print(f"    peak allocated (anonymous) {gb(L['peak_allocated'])}, the memory plan's {gb(L['plan_host'])} "
              f"({100 * (L['plan_host'] / L['peak_allocated'] - 1):+.0f}%); mapped files {gb(L['mapped_files'])}; frozen base "
              f"as stored {gb(L['frozen_bytes'] or 0)}")
    if L.get("ranks"):
        print(f"    on {L['ranks']} ranks: peak RSS per rank {', '.join(gb(b) for b in L['rank_peak_rss'])}; frozen base as "
              f"rank 0 stores it {gb(L['frozen_bytes'] or 0)}")
    if "resume" in r:
        print(f"  resume from ntoks/{a.batch * a.block}  {r['resume']['seconds']:.1f} s, peak RSS {gb(r['resume']['peak_rss'])} "
              f"({x(r['resume']['peak_rss'])})")
    if "export" in r:
        print(f"  export --format hf          {r['export']['seconds']:.1f} s, peak RSS {gb(r['export']['peak_rss'])} "
              f"({x(r['export']['peak_rss'])}), {gb(r['export']['bytes'])} written")
    if "copies" in r:
        print(f"  save_frozen_base=true       checkpoint {gb(r['copies']['checkpoint_bytes'])}")
    with open(a.out, "w") as f:
        json.dump(r, f, indent=2)
    print(f"wrote {a.out}")
    if any(r[k]["exit"] != 0 for k in ("import", "lora", "resume", "export", "copies") if k in r):
        sys.exit(f"scale_bench.py: a command failed; see {logs}")


if __name__ == "__main__":
    main()
