#!/usr/bin/env python3
"""What LoRA learns and forgets, next to full fine-tuning, from one base checkpoint.

From BASE (a plain checkpoint, an `export` or an `import-hf` output), trains on the TARGET dataset
with full fine-tuning (job kind `train`) and with LoRA (job kind `lora/train` without phase one) at
several ranks (alpha = 2r), learning rates, initialisations, and with or without trainable base
modules (`optimization/lora/modules_to_save`). Then evaluates every result, and the base, on TARGET
(what was learned) and SOURCE (what was forgotten) with `eval`, and writes:

  OUT/results.md                  the table (loss in nats, perplexity, change from the base, time)
  OUT/results.json                the same, for other tools
  OUT/learning_forgetting.svg     target loss against source loss, one labelled point per run

Only the standard library; the training is the launcher's (no new trainer). Every run gets the same
tokens, batch size, seed and data order. Re-running skips the runs that finished (delete OUT/ to
redo them).

Usage:
  scripts/learning_forgetting.py BASE TARGET SOURCE [--out DIR] [--tokens N] [--rows N] [--more]
      [--only LABEL,...] [--common 'key=value ...'] [--data-dir DIR] [--binary PATH]

  BASE      checkpoint directory (e.g. checkpoints/demo/default/demo/pre_lora_checkpoint)
  TARGET    dataset name under data/dir to train on (e.g. code)
  SOURCE    dataset name whose loss measures forgetting (e.g. english)
  --tokens  training tokens of every run (default 204800: 100 steps of the demo's 16 x 128)
  --rows    validation rows per dataset for the evaluation (default 64)
  --more    a larger grid (more learning rates, ranks and ratios): about three times as long
  --only    run only these labels (see the table; comma-separated)
  --common  overrides for every run, e.g. 'runtime/device=cuda'
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants(more):
    """(label, family, overrides). family: full | lora | lora+modules."""
    def lora(r, lr, init="gaussian", modules=None, ratio=None):
        o = [f"optimization/lora/rank={r}", f"optimization/lora/alpha={2 * r}", f"optimization/lora/lr={lr}",
             f"optimization/lora/init={init}"]
        label = f"LoRA r{r} lr {lr:g}" + (" kaiming" if init != "gaussian" else "")
        family = "lora"
        if modules:
            o.append("optimization/lora/modules_to_save=" + json.dumps(modules, separators=(",", ":")))
            o.append(f"optimization/lora/modules_to_save_lr_ratio={ratio}")
            label += f" + {'+'.join(modules)} x{ratio:g}"
            family = "lora+modules"
        return (label, family, o)

    def full(lr):
        return (f"full lr {lr:g}", "full", [f"optimization/lr={lr}"])

    out = [full(1e-3), full(3e-4),
           lora(16, 2e-3), lora(16, 2e-3, "kaiming_uniform"), lora(64, 2e-3),
           lora(256, 2e-3), lora(256, 2e-3, "kaiming_uniform"),
           lora(16, 2e-3, modules=["wte"], ratio=0.5), lora(16, 2e-3, modules=["wte"], ratio=0.1),
           lora(16, 2e-3, modules=["wte", "ln_1", "ln_2", "ln_f"], ratio=0.1)]
    if more:
        out += [full(1e-4),
                lora(16, 5e-3), lora(16, 1e-2), lora(64, 2e-3, "kaiming_uniform"), lora(64, 5e-3, "kaiming_uniform"),
                lora(16, 2e-3, modules=["wte"], ratio=0.25), lora(16, 2e-3, modules=["wte"], ratio=0.05),
                lora(16, 2e-3, modules=["ln_1", "ln_2", "ln_f"], ratio=1.0),
                lora(64, 2e-3, modules=["wte"], ratio=0.1)]
    return out


def die(msg):
    print(f"learning_forgetting: {msg}", file=sys.stderr)
    sys.exit(2)


def run(cmd, log):
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        die(f"`{' '.join(shlex.quote(c) for c in cmd)}` exited {p.returncode}; its log is {log}:\n{tail}")


def configure(binary, kind, path, base_cfg, tokens, target, out):
    """A config of `kind` with every key at its default, then the base's model, runtime and batch."""
    run([binary, "configure", "--force", kind, path], path + ".log")  # the script owns this file
    cfg = json.load(open(path))
    cfg["architecture"] = base_cfg["architecture"]
    for key in ("batch_size", "per_device_batch_size", "seed", "validation_steps"):
        if key in base_cfg.get("training", {}):
            cfg["training"][key] = base_cfg["training"][key]
    cfg["runtime"] = {k: v for k, v in base_cfg.get("runtime", {}).items() if k in cfg["runtime"]}
    cfg["data"]["dir"] = base_cfg.get("data", {}).get("dir", cfg["data"]["dir"])
    cfg["job"].update({"project": "learning_forgetting", "group": "runs"})
    stage = [{"name": target, "rate": 1, "style": "pmd"}]
    # The same shape of schedule for both: 5% warmup, flat, 10% decay (the LoRA phase's defaults).
    if kind == "train":
        cfg["training"].update({"tokens": tokens, "dataset": stage, "warmup_pct": 0.05, "decay_pct": 0.1})
    else:
        cfg["training"].update({"pre_lora_tokens": [], "pre_lora_dataset": [], "post_lora_tokens": [tokens],
                                "post_lora_dataset": [stage]})
    cfg["training"]["validation"] = False  # evaluated once at the end, on the same rows for every run
    cfg["logging"].update({"checkpoint_interval": 1000000, "validation_interval": 1000000, "report_interval": 25})
    json.dump(cfg, open(path, "w"), indent=2)


def evaluate(binary, ckpt, datasets, rows, common, log):
    cmd = [binary, "eval", ckpt, "--dataset", ",".join(datasets), "--rows", str(rows), "--json"] + common
    p = subprocess.run(cmd, capture_output=True, text=True)
    open(log, "w").write(p.stdout + p.stderr)
    if p.returncode != 0:
        die(f"`{' '.join(cmd)}` exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    out = json.loads(p.stdout)["datasets"]
    return {d: out[d]["loss"] for d in datasets}


def final_checkpoint(out, name):
    job = os.path.join(out, "checkpoints", "learning_forgetting", "runs", name)
    latest = os.path.join(job, "latest")
    if not os.path.exists(latest):
        return None
    rel = open(latest).read().strip()
    return os.path.join(job, rel) if rel.startswith("final/") else None


def svg_scatter(points, target, source, title, path):
    """points: [(label, family, x = target loss, y = source loss)], the base first."""
    W, H, L, R, T, B = 900, 520, 70, 330, 40, 60
    xs = [p[2] for p in points]
    ys = [p[3] for p in points]
    pad = lambda lo, hi: ((lo - 0.05 * (hi - lo or 1)), (hi + 0.05 * (hi - lo or 1)))
    x0, x1 = pad(min(xs), max(xs))
    y0, y1 = pad(min(ys), max(ys))
    X = lambda v: L + (v - x0) / (x1 - x0) * (W - L - R)
    Y = lambda v: H - B - (v - y0) / (y1 - y0) * (H - T - B)
    colour = {"base": "#000000", "full": "#d62728", "lora": "#1f77b4", "lora+modules": "#2ca02c"}
    esc = lambda s: s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{L}" y="22" font-size="14">{esc(title)}</text>',
         f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#888"/>']
    for i in range(6):
        xv = x0 + (x1 - x0) * i / 5
        yv = y0 + (y1 - y0) * i / 5
        s.append(f'<line x1="{X(xv):.1f}" y1="{H - B}" x2="{X(xv):.1f}" y2="{H - B + 4}" stroke="#888"/>')
        s.append(f'<text x="{X(xv):.1f}" y="{H - B + 16}" text-anchor="middle">{xv:.2f}</text>')
        s.append(f'<line x1="{L - 4}" y1="{Y(yv):.1f}" x2="{L}" y2="{Y(yv):.1f}" stroke="#888"/>')
        s.append(f'<text x="{L - 6}" y="{Y(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
    s.append(f'<text x="{(L + W - R) / 2}" y="{H - 18}" text-anchor="middle">{esc(target)} loss (nats): lower = learned more</text>')
    s.append(f'<text transform="translate(18 {(T + H - B) / 2}) rotate(-90)" text-anchor="middle">'
             f'{esc(source)} loss (nats): higher = forgot more</text>')
    # Each point carries its number; the list on the right names it (labels beside close points overlap).
    for i, (label, family, x, y) in enumerate(points):
        c = colour[family]
        if family == "base":
            s.append(f'<rect x="{X(x) - 5:.1f}" y="{Y(y) - 5:.1f}" width="10" height="10" fill="{c}"/>')
        else:
            s.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="4.5" fill="{c}" fill-opacity="0.8"/>')
        s.append(f'<text x="{X(x) + 6:.1f}" y="{Y(y) - 4:.1f}" fill="{c}" font-size="10">{i}</text>')
    for i, (label, family, x, y) in enumerate(points):
        ly = T + 12 + 16 * i
        s.append(f'<text x="{W - R + 12}" y="{ly}" fill="{colour[family]}">{i}  {esc(label)}</text>')
    key = [("full", "full fine-tuning"), ("lora", "LoRA (alpha = 2r)"), ("lora+modules", "LoRA + modules_to_save")]
    for j, (fam, text) in enumerate(key):
        ky = T + 12 + 16 * (len(points) + 1 + j)
        s.append(f'<circle cx="{W - R + 16}" cy="{ky - 4}" r="4.5" fill="{colour[fam]}"/>')
        s.append(f'<text x="{W - R + 26}" y="{ky}">{esc(text)}</text>')
    s.append("</svg>")
    tmp = path + ".tmp"
    open(tmp, "w").write("\n".join(s) + "\n")
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("target")
    ap.add_argument("source")
    ap.add_argument("--out", default="learning_forgetting")
    ap.add_argument("--tokens", type=int, default=204800)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--more", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--common", default="")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--binary", default=os.environ.get("LORA_TRAINER", os.path.join(ROOT, "build", "lora_trainer")))
    a = ap.parse_args()
    if not os.access(a.binary, os.X_OK):
        die(f"{a.binary} is not an executable lora_trainer; build it (bash scripts/setup.sh) or give --binary")
    meta_path = os.path.join(a.base, "metadata.json")
    if not os.path.isfile(meta_path):
        die(f"{a.base} is not a checkpoint (no metadata.json); give a checkpoint directory, e.g. "
            "checkpoints/demo/default/demo/pre_lora_checkpoint")
    meta = json.load(open(meta_path))
    if meta.get("kind") != "plain":
        die(f"{a.base} holds a {meta.get('kind')!r} state; the base must be plain (a pre_lora_checkpoint, an export "
            "or an import-hf output). To start from a LoRA checkpoint, `export` it first (merges the adapters)")
    if a.tokens <= 0 or a.rows <= 0:
        die("--tokens and --rows must be positive")
    base_cfg = meta.get("config", {})
    if a.data_dir:
        base_cfg.setdefault("data", {})["dir"] = os.path.abspath(a.data_dir)
    common = shlex.split(a.common)
    all_variants = variants(a.more)
    if a.only:
        wanted = [w.strip() for w in a.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in [v[0] for v in all_variants]]
        if unknown:
            die(f"--only: no run is labelled {unknown}; the labels: {[v[0] for v in all_variants]}")
        all_variants = [v for v in all_variants if v[0] in wanted]

    os.makedirs(a.out, exist_ok=True)
    out = os.path.abspath(a.out)
    base = os.path.abspath(a.base)
    if not meta.get("weights_only"):
        # A full state given to `run --restore` would be taken over with its counters (the `train` kind
        # continues it); its weights alone, exported once, start every run at step 0.
        base = os.path.join(out, "base")
        if not os.path.isfile(os.path.join(base, "metadata.json")):
            run([a.binary, "export", os.path.abspath(a.base), base], os.path.join(out, "export-base.log"))
    configs = {}
    for kind, file in (("train", "full.json"), ("lora/train", "lora.json")):
        configs[kind] = os.path.join(out, file)
        configure(a.binary, kind, configs[kind], base_cfg, a.tokens, a.target, out)

    started = time.time()
    earlier = {}  # training times of runs finished by an earlier invocation
    try:
        earlier = {r["label"]: r["seconds"] for r in json.load(open(os.path.join(out, "results.json")))["runs"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"base {a.base}: evaluating {a.target} and {a.source} ({a.rows} rows each)", flush=True)
    base_loss = evaluate(a.binary, base, [a.target, a.source], a.rows, common, os.path.join(out, "eval-base.log"))
    rows = [{"label": "base (before)", "family": "base", "target_loss": base_loss[a.target],
             "source_loss": base_loss[a.source], "seconds": 0, "overrides": []}]
    for i, (label, family, overrides) in enumerate(all_variants, 1):
        name = f"run{i:02d}-" + "".join(c if c.isalnum() else "_" for c in label)
        kind = "train" if family == "full" else "lora/train"
        ckpt = final_checkpoint(out, name)
        t0 = time.time()
        if ckpt is None:
            print(f"[{i}/{len(all_variants)}] {label}: training {a.tokens} tokens of {a.target}", flush=True)
            run([a.binary, "run", name, configs[kind], out, "--restore", base] + overrides + common,
                os.path.join(out, name + ".log"))
            ckpt = final_checkpoint(out, name)
            if ckpt is None:
                die(f"{name} finished without a final checkpoint; see {os.path.join(out, name + '.log')}")
            seconds = time.time() - t0
        else:
            print(f"[{i}/{len(all_variants)}] {label}: already trained ({ckpt})", flush=True)
            seconds = earlier.get(label, 0)
        loss = evaluate(a.binary, ckpt, [a.target, a.source], a.rows, common, os.path.join(out, name + "-eval.log"))
        rows.append({"label": label, "family": family, "target_loss": loss[a.target], "source_loss": loss[a.source],
                     "seconds": round(seconds, 1), "overrides": overrides, "checkpoint": ckpt})
        print(f"    {a.target} {loss[a.target]:.3f}  {a.source} {loss[a.source]:.3f}  ({seconds:.0f} s)", flush=True)

    b = rows[0]
    lines = [f"# What LoRA learns and forgets: {a.target} learned, {a.source} forgotten", "",
             f"Base: `{a.base}`. Every run: {a.tokens} tokens of `{a.target}`, then `eval --rows {a.rows}` on both "
             "datasets (loss in nats per token; perplexity = exp(loss)). Full fine-tuning uses the base's "
             "`optimization/weight_decay`; LoRA has alpha = 2r on every linear layer of the blocks, weight decay 0.", "",
             f"| run | {a.target} loss (learned) | {a.target} ppl | {a.source} loss (forgotten) | {a.source} ppl | "
             f"learned | forgotten | time (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['target_loss']:.3f} | {math.exp(r['target_loss']):.1f} | "
                     f"{r['source_loss']:.3f} | {math.exp(r['source_loss']):.1f} | "
                     f"{b['target_loss'] - r['target_loss']:+.3f} | {r['source_loss'] - b['source_loss']:+.3f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "learned = base loss - run loss on the target; forgotten = run loss - base loss on the source.",
              f"Total {time.time() - started:.0f} s. Overrides of each run: results.json."]
    table = "\n".join(lines) + "\n"
    for path, text in ((os.path.join(out, "results.md"), table),
                       (os.path.join(out, "results.json"), json.dumps({"base": a.base, "target": a.target,
                                                                        "source": a.source, "tokens": a.tokens,
                                                                        "rows": a.rows, "runs": rows}, indent=2) + "\n")):
        open(path + ".tmp", "w").write(text)
        os.replace(path + ".tmp", path)
    svg_scatter([(r["label"], r["family"], r["target_loss"], r["source_loss"]) for r in rows], a.target, a.source,
                f"learned ({a.target}) vs forgotten ({a.source}) after {a.tokens} tokens",
                os.path.join(out, "learning_forgetting.svg"))
    print("\n" + table)
    print(f"wrote {out}/results.md, results.json and learning_forgetting.svg")


if __name__ == "__main__":
    main()
