#!/usr/bin/env python3
"""Hugging Face transformers + PEFT on the model and batch of a lora_trainer benchmark, timed the way
`lora_trainer bench` times its steps: phase 1 (full fine-tuning) and phase 2 (LoRA adapters from PEFT
on the phase-1 model), each 3 warm-up + N timed steps on random token batches, tokens/s from the
median step.

Usage: scripts/hf_peft_bench.py [SOURCE_JSON] [--steps N] [--warmup N] [--device cuda|cpu] [--out FILE]
SOURCE_JSON is either what `lora_trainer bench ... --out BENCH_JSON` wrote (its resolved_config is
read) or a lora_trainer config file (configs/bench_gpt2_124m.json; keys missing there take
lora_trainer's defaults). Without one: GPT-2 124M (12 layers, d_model 768, 12 heads, block 1024, vocab
50257), 8 x 1024 tokens a step.

What it runs, as a Hugging Face user would write it:
- the model: transformers' GPT2LMHeadModel built from a GPT2Config of that size (tied embeddings, no
  dropout, layer-norm eps 1e-5, attn_implementation="sdpa" i.e. F.scaled_dot_product_attention,
  activation "gelu" = the exact GELU lora_trainer uses; --activation gelu_new for GPT-2's tanh
  approximation), f32 weights on the device, forward and loss under
  torch.autocast(device, dtype=torch.bfloat16) when the benchmark ran in bf16; the loss is the
  model's own (input_ids=labels=x, so B x (T-1) predicted tokens; B x T tokens counted, as lora_trainer
  counts them);
- phase 1: torch.optim.AdamW (defaults: foreach on CUDA) with the benchmark's lr, betas, eps and
  weight decay on matrices only, clip_grad_norm_(grad_clip), micro-batches of per_device_batch_size;
- phase 2: peft.get_peft_model(model, LoraConfig(r, lora_alpha, target_modules = the benchmark's
  optimization/lora/target_modules (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj), lora_dropout=0,
  fan_in_fan_out=True (GPT-2's Conv1D layers), bias="none")), the base frozen in f32 (PEFT's usual
  set-up; --lora-base-bf16 casts it to bf16 first, as lora_trainer's LoRA phase does), AdamW on the
  adapters with the LoRA lr and weight decay.
It also measures the GPU's bf16 matmul peak (8192^3) for MFU. Every error is caught, reported on
stderr and in the JSON ("errors"); the exit status is then 1.
"""
import argparse
import json
import math
import sys
import time
import traceback

DEFAULTS = {  # lora_trainer's defaults (lora_trainer/training/trainer.cpp, lora_trainer.cpp) where SOURCE_JSON has none
    "architecture": {"n_layers": 12, "d_model": 768, "n_heads": 12, "block_size": 1024, "vocab_size": 50257,
                     "dropout": 0.0},
    "training": {"batch_size": 8, "per_device_batch_size": 8},
    "optimization": {"lr": 6e-4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0,
                     "lora": {"rank": 16, "alpha": 32.0, "lr": 2e-3, "weight_decay": 0.0,
                              "target_modules": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]}},
    "runtime": {"precision": "bf16"},
}


def merge(base, over):
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def read_source(path):
    if not path:
        return DEFAULTS, "defaults (GPT-2 124M)"
    with open(path) as f:
        d = json.load(f)
    if "resolved_config" in d:  # lora_trainer bench's output
        cfg = merge(DEFAULTS, d["resolved_config"])
        prec = d.get("precision", "")
        cfg["runtime"] = dict(cfg.get("runtime", {}), precision="bf16" if prec.startswith("bf16") else "f32")
        return cfg, f"{path} (lora_trainer bench output)"
    return merge(DEFAULTS, d), f"{path} (lora_trainer config)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="lora_trainer bench output (bench.json) or config file")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--activation", default="gelu", help="GPT2Config.activation_function (gelu = exact, as lora_trainer)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2, ...)")
    ap.add_argument("--lora-base-bf16", action="store_true", help="cast the frozen base to bf16 for the LoRA phase")
    ap.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    ap.add_argument("--out", default="hf_peft.json")
    args = ap.parse_args()

    result = {"phases": [], "errors": []}

    def fail(where, exc):
        msg = f"{where}: {type(exc).__name__}: {exc}"
        print(f"hf_peft_bench: ERROR in {msg}", file=sys.stderr)
        traceback.print_exc()
        result["errors"].append(msg)

    def write():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")

    try:
        import torch
        import torch.nn.functional as F  # noqa: F401  (imported for the record: SDPA lives there)
        result["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001
        fail("import torch", e)
        write()
        return 1
    for mod in ("transformers", "peft"):
        try:
            result[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            fail(f"import {mod}", e)
    if "transformers" not in result:
        write()
        return 1

    cfg, src = read_source(args.source)
    a, t, o = cfg["architecture"], cfg["training"], cfg["optimization"]
    L, C, H, T, V = a["n_layers"], a["d_model"], a["n_heads"], a["block_size"], a["vocab_size"]
    B = t["batch_size"]
    micro = B if t.get("per_device_batch_size", -1) < 0 else min(B, t["per_device_batch_size"])
    bf16 = cfg.get("runtime", {}).get("precision", "bf16") != "f32"
    lcfg = o["lora"]
    device = torch.device(args.device)
    dev_type = device.type
    result.update({"source": src, "model": {"n_layers": L, "d_model": C, "n_heads": H, "block_size": T, "vocab_size": V},
                   "tokens_per_step": B * T, "micro_batch": micro, "precision": "bf16 autocast" if bf16 else "f32",
                   "lora_rank": lcfg["rank"], "lora_alpha": lcfg["alpha"], "warmup_steps": args.warmup,
                   "steps": args.steps})
    print(f"hf_peft_bench: {src}: {L} layers, d_model {C}, {H} heads, block {T}, vocab {V}; {B} x {T} tokens a step "
          f"in micro-batches of {micro}; {'bf16 autocast' if bf16 else 'f32'} on {device}")
    if dev_type == "cuda":
        if not torch.cuda.is_available():
            fail("device", RuntimeError("torch.cuda.is_available() is False"))
            write()
            return 1
        result["device"] = torch.cuda.get_device_name(device)

    def sync():
        if dev_type == "cuda":
            torch.cuda.synchronize(device)

    if dev_type == "cuda" and not args.no_peak:
        try:
            n = 8192
            x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                x @ y
            sync()
            best = math.inf
            for _ in range(10):
                t0 = time.perf_counter()
                x @ y
                sync()
                best = min(best, time.perf_counter() - t0)
            del x, y
            result["gpu_bf16_matmul_peak_tflops"] = 2.0 * n ** 3 / best / 1e12
            print(f"GPU bf16 matmul peak (8192^3): {result['gpu_bf16_matmul_peak_tflops']:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            fail("matmul peak", e)

    # The model.
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        gcfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H,
                          resid_pdrop=a.get("dropout", 0.0), embd_pdrop=a.get("dropout", 0.0),
                          attn_pdrop=a.get("dropout", 0.0), layer_norm_epsilon=1e-5,
                          activation_function=args.activation, tie_word_embeddings=True, use_cache=False,
                          bos_token_id=min(50256, V - 1), eos_token_id=min(50256, V - 1))
        try:  # transformers >= 4.36 (and 5): the attention implementation is chosen when the model is built
            model = GPT2LMHeadModel._from_config(gcfg, attn_implementation=args.attn)
        except (TypeError, AttributeError, ValueError) as e:
            print(f"hf_peft_bench: _from_config(attn_implementation=...) failed ({e}); setting the config's", file=sys.stderr)
            gcfg._attn_implementation = args.attn
            model = GPT2LMHeadModel(gcfg)
        model.to(device=device, dtype=torch.float32)
        model.train()
        result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        result["n_params"] = sum(p.numel() for p in model.parameters())
        print(f"model: {result['n_params'] / 1e6:.2f}M parameters, attention {result['attn_implementation']}, "
              f"activation {model.config.activation_function}")
    except Exception as e:  # noqa: BLE001
        fail("building GPT2LMHeadModel", e)
        write()
        return 1

    def make_step(params, lr, wd):
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, betas=(o["beta1"], o["beta2"]), eps=o["eps"])

        def step():
            x = torch.randint(0, V, (B, T), device=device)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for first in range(0, B, micro):
                chunk = x[first:first + micro]
                with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(input_ids=chunk, labels=chunk).loss * (chunk.shape[0] / B)
                loss.backward()
                total = total + loss.detach()
            if o.get("grad_clip", 0) > 0:
                torch.nn.utils.clip_grad_norm_(params, o["grad_clip"])
            opt.step()
            return total

        return step

    def run_phase(name, step, extra):
        if dev_type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first = None
        for i in range(args.warmup):
            loss = step()
            if i == 0:
                first = float(loss)
        sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        times.sort()
        med = times[len(times) // 2]
        ph = {"phase": name, "tokens_per_s": B * T / med, "step_s_median": med, "step_s_min": times[0],
              "step_s_max": times[-1], "first_step_loss": first}
        if dev_type == "cuda":
            ph["gpu_peak_mb"] = torch.cuda.max_memory_allocated(device) / 1048576
        ph.update(extra)
        result["phases"].append(ph)
        print(f"HF+PEFT {name:5s}: {ph['tokens_per_s']:10.0f} tok/s, step median {1000 * med:.1f} ms "
              f"(min {1000 * times[0]:.1f}, max {1000 * times[-1]:.1f})" +
              (f", peak GPU memory {ph['gpu_peak_mb']:.0f} MB" if "gpu_peak_mb" in ph else ""))

    # Phase 1: full fine-tuning.
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        run_phase("full", make_step(params, o["lr"], o["weight_decay"]), {"trainable_params": sum(p.numel() for p in params)})
    except Exception as e:  # noqa: BLE001
        fail("phase 1 (full fine-tuning)", e)
    if dev_type == "cuda":
        torch.cuda.empty_cache()

    # Phase 2: PEFT LoRA on the phase-1 model.
    try:
        from peft import LoraConfig, get_peft_model
        for p in model.parameters():
            p.grad = None
        if args.lora_base_bf16:
            model.to(torch.bfloat16)
        targets = list(dict.fromkeys(lcfg.get("target_modules") or DEFAULTS["optimization"]["lora"]["target_modules"]))
        if targets == ["all-linear"]:  # our default, PEFT's string form (a list would name a module "all-linear")
            targets = "all-linear"
        lora_kwargs = dict(r=lcfg["rank"], lora_alpha=lcfg["alpha"], target_modules=targets, lora_dropout=0.0,
                           fan_in_fan_out=True, bias="none")
        try:
            lconf = LoraConfig(task_type="CAUSAL_LM", **lora_kwargs)
        except (TypeError, ValueError) as e:
            print(f"hf_peft_bench: LoraConfig(task_type='CAUSAL_LM') failed ({e}); without task_type", file=sys.stderr)
            lconf = LoraConfig(**lora_kwargs)
        pmodel = get_peft_model(model, lconf)
        # PEFT creates the adapters in the base layer's dtype; keep them f32 (master weights) when the base is bf16.
        n_lora = 0
        for name, p in pmodel.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()
        for name, mod in pmodel.named_modules():
            if hasattr(mod, "lora_A") and hasattr(mod, "base_layer"):
                n_lora += 1
        params = [p for p in pmodel.parameters() if p.requires_grad]
        n_train = sum(p.numel() for p in params)
        print(f"PEFT: {n_lora} LoRA layers on {targets}, {n_train:,} trainable parameters, base "
              f"{'bf16' if args.lora_base_bf16 else 'f32'}")
        result["lora_modules"] = n_lora
        model = pmodel  # make_step calls `model`
        model.train()
        run_phase("lora", make_step(params, lcfg["lr"], lcfg.get("weight_decay", 0.0)),
                  {"trainable_params": n_train, "lora_modules": n_lora, "target_modules": targets,
                   "base_dtype": "bf16" if args.lora_base_bf16 else "f32"})
    except Exception as e:  # noqa: BLE001
        fail("phase 2 (PEFT LoRA)", e)

    write()
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
