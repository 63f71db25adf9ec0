#!/usr/bin/env python3
"""QLoRA's benchmark: the same LoRA job on a bf16 base and on an NF4 base, side by side in one run.

  python3 scripts/qlora_bench.py [--shape tinyllama-1.1b] [--work /tmp/lt_scale] [--out qlora.json] [-- KEY=VALUE ...]

Runs scripts/scale_bench.py twice on the same synthetic Hugging Face model (made once under --work):
its `lora` stage (a lora/train job without phase one, loading the directory: --steps steps of --batch
rows x --block tokens) and its `resume` stage, first with the base in bf16 and then with
optimization/lora/quantize_base=nf4; then prints, for each, the frozen base's bytes as stored (the
transition event's frozen_bytes) and per parameter, the job's peak RSS, load time, step times, the LoRA
checkpoint's size, the resume's peak RSS and time, and with runtime/device=cuda after `--` the job's
peak GPU memory; writes both results to --out. Settings after `--` go to both jobs. Record the
figures in docs/performance.md with the CPU/GPU model.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--shape", default="tinyllama-1.1b", help="make_hf_model.py's --shape (default tinyllama-1.1b)")
    ap.add_argument("--work", default="/tmp/lt_scale", help="working directory (the model is made once there)")
    ap.add_argument("--out", default="qlora.json", help="where to write the figures (JSON)")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "lora_trainer"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("overrides", nargs="*", help="key=value settings for both jobs (after --)")
    a = ap.parse_args()
    results = {}
    for name, extra in (("bf16", []), ("nf4", ["optimization/lora/quantize_base=nf4"])):
        out = os.path.join(a.work, f"qlora_{name}.json")
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "scale_bench.py"), "--shape", a.shape, "--work", a.work, "--out", out,
               "--binary", a.binary, "--steps", str(a.steps), "--batch", str(a.batch), "--block", str(a.block),
               "--skip", "import,copies,export", "--"] + a.overrides + extra
        print(f"=== {name} base: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode
        if not os.path.exists(out):
            sys.exit(f"qlora_bench.py: the {name} run wrote no figures (exit status {rc})")
        with open(out) as f:
            results[name] = json.load(f)
        results[name]["exit"] = rc

    gb = lambda b: f"{b / 1e9:.2f} GB" if b is not None else "-"
    b, q = results["bf16"], results["nf4"]
    rows = [("frozen base as stored", lambda r: gb(r["lora"]["frozen_bytes"]) +
             (f" ({r['lora']['frozen_bytes'] / r['lora']['frozen_params']:.3f} B/param)" if r["lora"]["frozen_params"] else "")),
            ("the quantized weights alone", lambda r: (
                f"{(r['lora']['frozen_bytes'] - 2 * (r['lora']['frozen_params'] - r['lora']['quantized_params'])) / r['lora']['quantized_params']:.3f} B/param"
                if r["lora"].get("quantized_params") else "-")),
            ("LoRA job, peak RSS", lambda r: gb(r["lora"]["peak_rss"])),
            ("LoRA job, peak GPU memory", lambda r: gb(r["lora"]["gpu_peak_bytes"])),
            ("loading the base", lambda r: f"{r['lora']['load_s']} s"),
            (f"steps ({a.batch} x {a.block} tokens)", lambda r: ", ".join(f"{t:.2f}" for t in r["lora"]["step_s"]) + " s"),
            ("LoRA checkpoint", lambda r: f"{r['lora']['checkpoint_bytes'] / 1e6:.1f} MB"),
            ("resume, peak RSS and time", lambda r: f"{gb(r['resume']['peak_rss'])}, {r['resume']['seconds']:.1f} s")]
    print(f"\nQLoRA benchmark: {a.shape} ({gb(b['base_bf16_bytes'])} of bf16 weights); {b['cpu']}"
          + (f"; settings {' '.join(a.overrides)}" if a.overrides else ""))
    print(f"  {'':34} {'bf16 base':>28} {'NF4 base':>28}")
    for label, f in rows:
        print(f"  {label:34} {f(b):>28} {f(q):>28}")
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")
    if b["exit"] or q["exit"]:
        sys.exit("qlora_bench.py: a run failed; see the logs under " + os.path.join(a.work, "logs"))


if __name__ == "__main__":
    main()
