#!/usr/bin/env python3
"""Golden files from the real Hugging Face libraries for lora_trainer's GPT-2 import and exports
(docs/huggingface.md), and checks of what lora_trainer writes, with those libraries.

Modes:
  make OUT_DIR
      A small random GPT2LMHeadModel (vocab 300, n_embd 32, 2 layers, 4 heads, n_positions 32,
      activation gelu_new, tied head), its weights perturbed so that the logits are far from uniform,
      saved with save_pretrained (safetensors, f32) as OUT_DIR/model/; the same model in bf16, sharded
      (model.safetensors.index.json), as OUT_DIR/model_bf16_sharded/; fixed token ids
      OUT_DIR/ids.json ({"ids": [[...], [...]]}, 2 x 16) and the f32 model's logits on them,
      OUT_DIR/logits.safetensors ("logits", f32, (2, 16, 300)). Deterministic (seed 0); committed as
      tests/data/hf_gpt2/.
  check-hf EXPORT_DIR IDS_JSON EXPECTED_SAFETENSORS [--tol T]
      Loads `lora_trainer export --format hf` output with transformers (AutoModelForCausalLM, which
      must pick GPT2LMHeadModel), computes the logits of the ids and prints the max abs difference
      from EXPECTED's "logits" (e.g. written by lora_trainer's tests). Exit 1 above --tol (1e-4).
  check-adapter ADAPTER_DIR [--base HF_DIR]
      Reads ADAPTER_DIR/adapter_model.safetensors with the real safetensors library and
      adapter_config.json, and checks PEFT's documented layout: keys
      base_model.model.<module>.lora_A.weight (r, in) and .lora_B.weight (out, r), one pair per
      module, r and the module list as the config says. With --base, also the in/out sizes against the
      base model's Conv1D weights (in, out).
  peft-logits HF_BASE_DIR ADAPTER_DIR IDS_JSON EXPECTED_SAFETENSORS [--tol T]
      Needs `peft` (not in Debian; any machine with the usual Python ML stack): loads the base with
      transformers, the adapter with PeftModel.from_pretrained, and prints the max abs difference of
      its logits, unmerged and after merge_and_unload(), from EXPECTED's "logits". Exit 1 above --tol.
  peft-convention
      Needs `peft`; reads no file of ours. Wraps a small random GPT2LMHeadModel with
      get_peft_model(LoraConfig(r=4, lora_alpha=8, target_modules=["attn.c_attn", "mlp.c_fc",
      "mlp.c_proj"], fan_in_fan_out=True), random adapters), saves it, and prints what
      lora_trainer's export relies on: the modules those targets select (not attn.c_proj), the saved
      keys and shapes (lora_A (r, in), lora_B (out, r)), and the max abs difference between PEFT's
      logits and the base with W (in, out) += (lora_alpha / r) (lora_B @ lora_A)^T applied by hand.
  manual-merge HF_BASE_DIR ADAPTER_DIR IDS_JSON EXPECTED_SAFETENSORS [--tol T]
      The same without peft: applies each adapter by hand as PEFT does for a Conv1D layer with
      fan_in_fan_out=True, W (in, out) += (lora_alpha / r) * (lora_B @ lora_A)^T, and compares logits.

Run inside a chroot with Debian sid's stack: see docs/huggingface.md ("Checking with the real libraries").
"""
import argparse
import json
import os
import sys

import torch

VOCAB, N_EMBD, N_LAYER, N_HEAD, N_POSITIONS = 300, 32, 2, 4, 32
SEED = 0


def load_ids(path):
    with open(path) as f:
        return torch.tensor(json.load(f)["ids"], dtype=torch.long)


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def compare(name, got, expected, tol):
    diff = (got - expected).abs().max().item()
    print(f"{name}: max abs diff {diff:.3e} over {tuple(got.shape)} logits (tolerance {tol:g})")
    return diff <= tol


def make(out_dir):
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=N_POSITIONS, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():  # far from the init: logits spread over several nats, every tensor nonzero
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("wte.weight"):
                p.copy_(0.4 * noise)
            elif "ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(os.path.join(out_dir, "model"), safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(os.path.join(out_dir, "model_bf16_sharded"), safe_serialization=True,
                                             max_shard_size="40KB")
    model.to(torch.float32)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    with open(os.path.join(out_dir, "ids.json"), "w") as f:
        json.dump({"ids": ids.tolist()}, f)
        f.write("\n")
    # Logits in f32 on the CPU, eager attention: the reference the import is measured against.
    ref = GPT2LMHeadModel.from_pretrained(os.path.join(out_dir, "model"), attn_implementation="eager")
    logits = logits_of(ref, ids).contiguous()
    save_file({"logits": logits}, os.path.join(out_dir, "logits.safetensors"))
    probs = torch.softmax(logits, -1)
    print(f"wrote {out_dir}: logits std {logits.std().item():.3f}, mean max prob {probs.max(-1).values.mean().item():.3f} "
          f"(uniform would be {1 / VOCAB:.4f})")


def check_hf(args):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.export_dir, attn_implementation="eager")
    print(f"{args.export_dir}: transformers loaded {type(model).__name__}")
    if type(model).__name__ != "GPT2LMHeadModel":
        print("error: expected GPT2LMHeadModel", file=sys.stderr)
        return 1
    ok = compare("export --format hf vs expected", logits_of(model, load_ids(args.ids)),
                 load_file(args.expected)["logits"], args.tol)
    return 0 if ok else 1


def check_adapter(args):
    from safetensors import safe_open

    with open(os.path.join(args.adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    problems = []
    for key, want in (("peft_type", "LORA"), ("task_type", "CAUSAL_LM"), ("fan_in_fan_out", True), ("bias", "none")):
        if cfg.get(key) != want:
            problems.append(f"adapter_config.json: {key} is {cfg.get(key)!r}, expected {want!r}")
    r = cfg["r"]
    tensors = {}
    with safe_open(os.path.join(args.adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    modules = sorted({k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})
    base_sd = None
    if args.base:
        from transformers import AutoModelForCausalLM
        base_sd = AutoModelForCausalLM.from_pretrained(args.base).state_dict()
    for m in modules:
        if not m.startswith("base_model.model."):
            problems.append(f"{m}: key does not start with base_model.model.")
        a, b = tensors.get(m + ".lora_A.weight"), tensors.get(m + ".lora_B.weight")
        if b is None:
            problems.append(f"{m}: lora_B.weight missing")
            continue
        if a.dim() != 2 or a.shape[0] != r or b.dim() != 2 or b.shape[1] != r:
            problems.append(f"{m}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; expected (r={r}, in) and (out, r)")
        if base_sd is not None:
            w = base_sd.get(m[len("base_model.model."):] + ".weight")
            if w is None:
                problems.append(f"{m}: no such module in the base")
            elif (w.shape[0], w.shape[1]) != (a.shape[1], b.shape[0]):  # Conv1D: (in, out)
                problems.append(f"{m}: base Conv1D weight {tuple(w.shape)} (in, out) does not fit lora_A {tuple(a.shape)}, "
                                f"lora_B {tuple(b.shape)}")
        targets = cfg.get("target_modules") or []
        name = m[len("base_model.model."):]
        if not any(name == t or name.endswith("." + t) for t in targets):
            problems.append(f"{m}: not matched by target_modules {targets}")
    # modules_to_save: base_model.model.<module>.<param>, the whole module, for each listed module.
    saved = cfg.get("modules_to_save") or []
    for k in tensors:
        if k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"):
            continue
        name = k[len("base_model.model."):]
        module = name.rsplit(".", 1)[0]
        if not k.startswith("base_model.model.") or module not in saved:
            problems.append(f"unexpected key {k} (modules_to_save is {saved})")
        elif base_sd is not None and (name not in base_sd or base_sd[name].shape != tensors[k].shape):
            problems.append(f"{k}: the base has no {name} of shape {tuple(tensors[k].shape)}")
    print(f"{args.adapter_dir}: {len(modules)} adapted modules, r {r}, lora_alpha {cfg.get('lora_alpha')}, "
          f"scaling = {cfg.get('lora_alpha') / (r ** 0.5 if cfg.get('use_rslora') else r):g}"
          f"{' (use_rslora: lora_alpha/sqrt(r))' if cfg.get('use_rslora') else ' (lora_alpha/r)'}; {len(tensors)} tensors read with safetensors "
          f"{__import__('safetensors').__version__}")
    for p in problems:
        print("error: " + p, file=sys.stderr)
    return 1 if problems else 0


def manual_merge(args):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="eager")
    with open(os.path.join(args.adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    scaling = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    ad = load_file(os.path.join(args.adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in ad.items():
            if not k.endswith(".lora_A.weight"):
                continue
            m = k[len("base_model.model."): -len(".lora_A.weight")]
            b = ad[k.replace("lora_A", "lora_B")]
            delta = (b.float() @ a.float()) * scaling  # (out, in)
            w = params[m + ".weight"]
            w += delta.T if cfg.get("fan_in_fan_out") else delta
        # modules_to_save replace their module's parameters (GPT-2's lm_head is tied to transformer.wte:
        # named_parameters() lists the shared tensor once, as transformer.wte.weight).
        for k, t in ad.items():
            if ".lora_A." in k or ".lora_B." in k:
                continue
            name = k[len("base_model.model."):]
            if name in params:
                params[name].copy_(t)
            elif not (name == "lm_head.weight" and torch.equal(t, ad.get("base_model.model.transformer.wte.weight", t * 0 + 1))):
                raise SystemExit(f"error: {k} names no parameter of the base (and is not the tied head)")
    ok = compare("base + adapters merged by hand vs expected", logits_of(model, load_ids(args.ids)),
                 load_file(args.expected)["logits"], args.tol)
    return 0 if ok else 1


def peft_logits(args):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids, expected = load_ids(args.ids), load_file(args.expected)["logits"]
    base = AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, args.adapter_dir)
    ok = compare("PeftModel (unmerged) vs expected", logits_of(model, ids), expected, args.tol)
    merged = model.merge_and_unload()
    ok = compare("PeftModel merge_and_unload vs expected", logits_of(merged, ids), expected, args.tol) and ok
    return 0 if ok else 1


def peft_convention(args):
    import tempfile

    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=N_POSITIONS, n_embd=N_EMBD, n_layer=N_LAYER,
                                      n_head=N_HEAD, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    r, alpha = 4, 8
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=["attn.c_attn", "mlp.c_fc", "mlp.c_proj"],
                                            fan_in_fan_out=True, task_type="CAUSAL_LM", init_lora_weights=False))
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    print("adapted:", adapted)
    ok = not any("attn.c_proj" in n for n in adapted) and len(adapted) == 3 * N_LAYER
    out = tempfile.mkdtemp()
    model.save_pretrained(out)
    ids = torch.randint(0, VOCAB, (2, 16))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        plain = GPT2LMHeadModel(base.config)
        sd = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
              for k, v in model.state_dict().items() if "lora_" not in k}
        plain.load_state_dict(sd, strict=False)
        params = dict(plain.named_parameters())
        with safe_open(os.path.join(out, "adapter_model.safetensors"), framework="pt") as f:
            for k in sorted(f.keys()):
                t = f.get_tensor(k)
                print(k, tuple(t.shape))
                if ".lora_A." in k:
                    b = f.get_tensor(k.replace("lora_A", "lora_B"))
                    ok = ok and t.shape[0] == r and b.shape[1] == r
                    name = k[len("base_model.model."):].replace(".lora_A.weight", ".weight")
                    params[name] += (b @ t).T * (alpha / r)
        plain.eval()
        ok = compare("PEFT vs W += (lora_alpha/r)(lora_B @ lora_A)^T by hand", plain(input_ids=ids).logits, want, 1e-4) and ok
        with model.disable_adapter():
            print(f"the adapters' effect on the logits: {(model(input_ids=ids).logits - want).abs().max().item():.3e}")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("make")
    m.add_argument("out_dir")
    c = sub.add_parser("check-hf")
    c.add_argument("export_dir")
    c.add_argument("ids")
    c.add_argument("expected")
    c.add_argument("--tol", type=float, default=1e-4)
    a = sub.add_parser("check-adapter")
    a.add_argument("adapter_dir")
    a.add_argument("--base")
    sub.add_parser("peft-convention")
    for name in ("peft-logits", "manual-merge"):
        q = sub.add_parser(name)
        q.add_argument("base")
        q.add_argument("adapter_dir")
        q.add_argument("ids")
        q.add_argument("expected")
        q.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args()
    if args.mode == "make":
        make(args.out_dir)
        return 0
    return {"check-hf": check_hf, "check-adapter": check_adapter, "peft-logits": peft_logits,
            "manual-merge": manual_merge, "peft-convention": peft_convention}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
