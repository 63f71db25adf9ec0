#!/usr/bin/env python3
"""Golden files from the real Hugging Face libraries for lora_trainer's GPT-2 and llama-family imports and
exports (docs/huggingface.md), and checks of what lora_trainer writes, with those libraries.

Modes:
  make OUT_DIR [--family gpt2|llama|qwen2|llama3]
      gpt2 (the default): a small random GPT2LMHeadModel (vocab 300, n_embd 32, 2 layers, 4 heads, n_positions 32,
      activation gelu_new, tied head), its weights perturbed so that the logits are far from uniform,
      saved with save_pretrained (safetensors, f32) as OUT_DIR/model/; the same model in bf16, sharded
      (model.safetensors.index.json), as OUT_DIR/model_bf16_sharded/; fixed token ids
      OUT_DIR/ids.json ({"ids": [[...], [...]]}, 2 x 16) and the f32 model's logits on them (eager attention),
      OUT_DIR/logits.safetensors ("logits", f32, (2, 16, 300)). Deterministic (seed 0); committed as
      tests/data/hf_gpt2/.
      llama: the same layout for a LlamaForCausalLM (vocab 300, hidden 32, intermediate 80, 2 layers, 4 heads of 8,
      2 kv heads (GQA), 64 positions, rms_norm_eps 1e-5, rope_theta 1e4 (config.json: rope_parameters), SiLU, no
      biases, untied lm_head; seed 10): tests/data/hf_llama/. qwen2: a Qwen2ForCausalLM of the same sizes with 1 kv
      head, q/k/v biases, rms_norm_eps 1e-6, rope_theta 1e6, tied lm_head (absent from model.safetensors), no sliding
      window (seed 20): tests/data/hf_qwen2/. llama3: the llama model with Llama 3.1's scaled rotary embedding
      (rope_type llama3, theta 100, factor 8, low/high_freq_factor 1/4, original_max_position_embeddings 64 of 512, so its
      four frequencies are kept, smoothed and divided), 2 kv heads, tied head (seed 30): tests/data/hf_llama3/.
      Prints config.json, what the file holds and how much RoPE moves the
      logits.
  check-hf EXPORT_DIR IDS_JSON EXPECTED_SAFETENSORS [--tol T] [--expect-class NAME]
      Loads `lora_trainer export --format hf` output with transformers (AutoModelForCausalLM, which
      must pick GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM, or NAME), computes
      the logits of the ids and prints the max abs difference from EXPECTED's "logits" (e.g. written by
      lora_trainer's tests). Exit 1 above --tol (1e-4).
  check-adapter ADAPTER_DIR [--base HF_DIR]
      Reads ADAPTER_DIR/adapter_model.safetensors with the real safetensors library and
      adapter_config.json, and checks PEFT's documented layout: keys
      base_model.model.<module>.lora_A.weight (r, in) and .lora_B.weight (out, r), one pair per
      module, r and the module list as the config says, modules_to_save keys
      base_model.model.<module>.<param> for modules that an entry names (whole name or suffix). With --base,
      also the in/out sizes against the base's layers (GPT-2's Conv1D weight (in, out), which needs
      fan_in_fan_out true; nn.Linear's (out, in), which needs it false), the modules_to_save names and shapes,
      and notes on tied parameters (a tied lm_head and token embedding) that the adapter saves apart. With
      trainable_token_indices: one base_model.model.<embedding>.token_adapter.trainable_tokens_delta of
      (len(ids), dim), with --base the base's input embedding, wide enough and holding every id.
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
      The same without peft: applies each adapter by hand as PEFT does, with scaling lora_alpha / r
      (lora_alpha / sqrt(r) with use_rslora): for a Conv1D layer (fan_in_fan_out true)
      W (in, out) += scaling * (lora_B @ lora_A)^T, for an nn.Linear (fan_in_fan_out false)
      W (out, in) += scaling * lora_B @ lora_A (PEFT goes by the layer's type; a config that disagrees is
      warned about); then replaces the modules_to_save parameters with the adapter's tensors (a tied
      parameter is untied first, as PEFT's per-module copies do, so a tied embedding and lm_head both listed
      are each set), and the rows trainable_token_indices names with the
      <embedding>.token_adapter.trainable_tokens_delta rows (a tied head follows), and compares logits.

Run inside a chroot with Debian sid's stack: see docs/huggingface.md ("Checking with the real libraries").
"""
import argparse
import json
import os
import sys

import torch

VOCAB, N_EMBD, N_LAYER, N_HEAD, N_POSITIONS = 300, 32, 2, 4, 32
SEED = 0
CAUSAL_LM_CLASSES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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


def perturb(model, gen):
    """Far from the init: logits spread over several nats, every tensor nonzero. Token embeddings (and an untied
    lm_head, the output embedding) 0.4 noise, norm gains 1 + 0.2 noise, biases 0.1 noise, the rest 0.15 noise."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is listed once, as the embedding
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("wte.weight") or name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                p.copy_(0.4 * noise)
            elif ("ln_" in name or "norm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def write_ids_and_logits(out_dir, model_class, gen):
    from safetensors.torch import save_file

    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    with open(os.path.join(out_dir, "ids.json"), "w") as f:
        json.dump({"ids": ids.tolist()}, f)
        f.write("\n")
    # Logits in f32 on the CPU, eager attention: the reference the import is measured against.
    ref = model_class.from_pretrained(os.path.join(out_dir, "model"), attn_implementation="eager")
    logits = logits_of(ref, ids).contiguous()
    save_file({"logits": logits}, os.path.join(out_dir, "logits.safetensors"))
    return ref, ids, logits


def make(out_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=N_POSITIONS, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    perturb(model, gen)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(os.path.join(out_dir, "model"), safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(os.path.join(out_dir, "model_bf16_sharded"), safe_serialization=True,
                                             max_shard_size="40KB")
    model.to(torch.float32)
    _, _, logits = write_ids_and_logits(out_dir, GPT2LMHeadModel, gen)
    probs = torch.softmax(logits, -1)
    print(f"wrote {out_dir}: logits std {logits.std().item():.3f}, mean max prob {probs.max(-1).values.mean().item():.3f} "
          f"(uniform would be {1 / VOCAB:.4f})")


# The llama family: hidden 32, intermediate 80 (not 4 x hidden), 2 layers, 4 heads of 8, 64 positions, SiLU.
LLAMA_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, hidden_act="silu", attention_dropout=0.0)


def llama_family(family):
    """(config, model class, seed) of make --family llama|qwen2."""
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaConfig(**LLAMA_SIZES, num_key_value_heads=2, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2), LlamaForCausalLM, SEED + 10
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2Config(**LLAMA_SIZES, num_key_value_heads=1, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=True, use_sliding_window=False,
                           bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1), Qwen2ForCausalLM, SEED + 20
    if family == "llama3":
        # Llama 3.1's scaled rotary embedding, sized so that the tiny model's 4 frequencies fall in all three
        # regimes (wavelengths 6.3 < 16 kept, 19.9 and 62.8 smoothed, 198.7 > 64 divided by the factor).
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaConfig(**dict(LLAMA_SIZES, max_position_embeddings=512), num_key_value_heads=2, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64},
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
                           bos_token_id=1, eos_token_id=2), LlamaForCausalLM, SEED + 30
    raise SystemExit(f"error: unknown family {family!r}")


def make_llama_family(out_dir, family):
    from safetensors import safe_open

    config, model_class, seed = llama_family(family)
    torch.manual_seed(seed)
    model = model_class(config)
    gen = torch.Generator().manual_seed(seed + 1)
    perturb(model, gen)
    os.makedirs(out_dir, exist_ok=True)
    model_dir, bf16_dir = os.path.join(out_dir, "model"), os.path.join(out_dir, "model_bf16_sharded")
    model.save_pretrained(model_dir, safe_serialization=True)
    f32_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True, max_shard_size="40KB")
    ref, ids, logits = write_ids_and_logits(out_dir, model_class, gen)
    probs = torch.softmax(logits, -1)
    with open(os.path.join(model_dir, "config.json")) as f:
        saved_cfg = json.load(f)
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
    with open(os.path.join(bf16_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    print(f"wrote {out_dir} ({model_class.__name__}): logits std {logits.std().item():.3f}, mean max prob "
          f"{probs.max(-1).values.mean().item():.3f} (uniform would be {1 / VOCAB:.4f})")
    print(f"  config.json: {json.dumps(saved_cfg, sort_keys=True)}")
    print(f"  model.safetensors: {len(keys)} tensors, lm_head.weight {'present' if 'lm_head.weight' in keys else 'absent'}"
          f" (tie_word_embeddings {saved_cfg.get('tie_word_embeddings')}); model_bf16_sharded: {len(shards)} shards")
    with torch.no_grad():
        ref.eval()
        no_rope = ref(input_ids=ids, position_ids=torch.zeros_like(ids)).logits
        bf16 = logits_of(model_class.from_pretrained(bf16_dir, attn_implementation="eager"), ids)
    print(f"  all positions 0 (no rotation) moves the logits by {(no_rope - logits).abs().max().item():.3f}; "
          f"the bf16 shards' logits differ by {(bf16 - logits).abs().max().item():.3f}; model/ reloads the f32 "
          f"weights {'exactly' if all(torch.equal(v, f32_state[k]) for k, v in ref.state_dict().items()) else 'WITH CHANGES'}")
    if family == "qwen2":
        print(f"  sliding_window {ref.config.sliding_window}, layer_types {ref.config.layer_types}")


def check_hf(args):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.export_dir, attn_implementation="eager")
    got = type(model).__name__
    print(f"{args.export_dir}: transformers loaded {got}")
    if got not in CAUSAL_LM_CLASSES or (args.expect_class and got != args.expect_class):
        print(f"error: expected {args.expect_class or ' or '.join(CAUSAL_LM_CLASSES)}", file=sys.stderr)
        return 1
    ok = compare("export --format hf vs expected", logits_of(model, load_ids(args.ids)),
                 load_file(args.expected)["logits"], args.tol)
    return 0 if ok else 1


def lora_layer_kind(module):
    """'conv1d' (GPT-2's Conv1D, weight (in, out), PEFT needs fan_in_fan_out true) or 'linear' (nn.Linear, weight
    (out, in), fan_in_fan_out false); None for anything else."""
    if type(module).__name__ == "Conv1D":
        return "conv1d"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    return None


def saved_module_matches(module, saved):
    """PEFT's rule for a modules_to_save entry: the module's full name, or a suffix of it after a dot."""
    return any(module == t or module.endswith("." + t) for t in saved)


def lora_scaling(cfg):
    return cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])


def check_adapter(args):
    from safetensors import safe_open

    with open(os.path.join(args.adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    problems, notes = [], []
    for key, want in (("peft_type", "LORA"), ("task_type", "CAUSAL_LM"), ("bias", "none")):
        if cfg.get(key) != want:
            problems.append(f"adapter_config.json: {key} is {cfg.get(key)!r}, expected {want!r}")
    fan_in_fan_out = cfg.get("fan_in_fan_out")
    if not isinstance(fan_in_fan_out, bool):
        problems.append(f"adapter_config.json: fan_in_fan_out is {fan_in_fan_out!r}, expected true or false")
    r = cfg["r"]
    tensors = {}
    with safe_open(os.path.join(args.adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    modules = sorted({k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})
    base, base_sd = None, None
    if args.base:
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(args.base)
        base_sd = base.state_dict()  # tied parameters under each name (a tied lm_head.weight too)
    kinds = set()
    for m in modules:
        if not m.startswith("base_model.model."):
            problems.append(f"{m}: key does not start with base_model.model.")
        a, b = tensors.get(m + ".lora_A.weight"), tensors.get(m + ".lora_B.weight")
        if b is None:
            problems.append(f"{m}: lora_B.weight missing")
            continue
        if a.dim() != 2 or a.shape[0] != r or b.dim() != 2 or b.shape[1] != r:
            problems.append(f"{m}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; expected (r={r}, in) and (out, r)")
        name = m[len("base_model.model."):]
        if base is not None:
            try:
                module = base.get_submodule(name)
            except AttributeError:
                module = None
            kind = lora_layer_kind(module) if module is not None else None
            if module is None:
                problems.append(f"{m}: no such module in the base")
            elif kind is None:
                problems.append(f"{m}: the base's {name} is a {type(module).__name__}, not a Conv1D or nn.Linear")
            else:
                kinds.add(kind)
                w = module.weight
                in_out = (w.shape[0], w.shape[1]) if kind == "conv1d" else (w.shape[1], w.shape[0])
                if in_out != (a.shape[1], b.shape[0]):
                    layout = "Conv1D weight (in, out)" if kind == "conv1d" else "nn.Linear weight (out, in)"
                    problems.append(f"{m}: base {layout} {tuple(w.shape)} does not fit lora_A {tuple(a.shape)}, "
                                    f"lora_B {tuple(b.shape)}")
                if fan_in_fan_out != (kind == "conv1d"):
                    problems.append(f"{m}: the base's {name} is {'a Conv1D' if kind == 'conv1d' else 'an nn.Linear'}, "
                                    f"which needs fan_in_fan_out {str(kind == 'conv1d').lower()} (adapter_config.json "
                                    f"says {fan_in_fan_out!r}; PEFT would warn and override it)")
        targets = cfg.get("target_modules") or []
        if isinstance(targets, str):
            problems.append(f"target_modules is the regex {targets!r}: not checked")
        elif not any(name == t or name.endswith("." + t) for t in targets):
            problems.append(f"{m}: not matched by target_modules {targets}")
    # trainable_token_indices: base_model.model.<embedding>.token_adapter.trainable_tokens_delta, (len(ids), dim)
    token_ids = token_indices(cfg)
    token_keys = [k for k in tensors if k.endswith(TOKENS_DELTA)]
    if token_ids is not None and len(token_keys) != 1:
        problems.append(f"trainable_token_indices is {cfg['trainable_token_indices']} but the file holds "
                        f"{len(token_keys)} *{TOKENS_DELTA} tensors")
    for k in token_keys:
        t, name = tensors[k], k[len("base_model.model."): -len(TOKENS_DELTA)]
        if token_ids is None:
            problems.append(f"unexpected key {k} (trainable_token_indices is not set)")
        elif t.dim() != 2 or t.shape[0] != len(token_ids):
            problems.append(f"{k}: shape {tuple(t.shape)}, expected ({len(token_ids)} ids, dim)")
        if base is not None:
            emb = base.get_input_embeddings()
            if base.get_submodule(name) is not emb:
                problems.append(f"{k}: {name} is not the base's input embedding")
            elif t.shape[1:] != emb.weight.shape[1:] or max(token_ids or [0]) >= emb.weight.shape[0]:
                problems.append(f"{k}: {tuple(t.shape)} rows of ids {token_ids} do not fit the embedding "
                                f"{tuple(emb.weight.shape)}")
    # modules_to_save: base_model.model.<module>.<param>, the whole module, for each listed module.
    saved = cfg.get("modules_to_save") or []
    saved_keys = {}
    for k in tensors:
        if k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight") or k.endswith(TOKENS_DELTA):
            continue
        name = k[len("base_model.model."):]
        module = name.rsplit(".", 1)[0]
        if not k.startswith("base_model.model.") or not saved_module_matches(module, saved):
            problems.append(f"unexpected key {k} (modules_to_save is {saved})")
            continue
        saved_keys[name] = tensors[k]
        if base_sd is not None and (name not in base_sd or base_sd[name].shape != tensors[k].shape):
            problems.append(f"{k}: the base has no {name} of shape {tuple(tensors[k].shape)}")
    for t in saved:
        if not any(saved_module_matches(n.rsplit(".", 1)[0], [t]) for n in saved_keys):
            problems.append(f"modules_to_save entry {t!r} has no tensor in the file")
    if base is not None:  # tied parameters (e.g. lm_head.weight and the token embedding) saved under each name
        for names in tied_groups(base):
            listed = [n for n in names if n in saved_keys]
            if len(listed) > 1 and not all(torch.equal(saved_keys[n], saved_keys[listed[0]]) for n in listed):
                notes.append(f"the base ties {', '.join(names)}; the adapter's {', '.join(listed)} differ, so a merged "
                             "export cannot keep them tied")
            elif listed and len(listed) < len(names):
                notes.append(f"the base ties {', '.join(names)}; the adapter saves only {', '.join(listed)} (PEFT "
                             "replaces that module alone, the others keep the base's tensor)")
    print(f"{args.adapter_dir}: {len(modules)} adapted modules"
          f"{' (' + ', '.join(sorted(kinds)) + ')' if kinds else ''}, r {r}, lora_alpha {cfg.get('lora_alpha')}, "
          f"fan_in_fan_out {fan_in_fan_out}, scaling = {lora_scaling(cfg):g}"
          f"{' (use_rslora: lora_alpha/sqrt(r))' if cfg.get('use_rslora') else ' (lora_alpha/r)'}; "
          f"{len(saved_keys)} modules_to_save tensors; "
          f"{len(token_ids) if token_keys and token_ids else 0} trainable token rows; {len(tensors)} tensors read with safetensors "
          f"{__import__('safetensors').__version__}")
    for n in notes:
        print("note: " + n)
    for p in problems:
        print("error: " + p, file=sys.stderr)
    return 1 if problems else 0


TOKENS_DELTA = ".token_adapter.trainable_tokens_delta"


def token_indices(cfg):
    """The ids of adapter_config.json's trainable_token_indices (a list, or a dict of one module), or None."""
    ids = cfg.get("trainable_token_indices")
    if isinstance(ids, dict):
        return next(iter(ids.values())) if len(ids) == 1 else None
    return ids


def tied_groups(model):
    """Lists of parameter names that share one tensor (e.g. ["model.embed_tokens.weight", "lm_head.weight"])."""
    by_id = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return [names for names in by_id.values() if len(names) > 1]


def manual_merge(args):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="eager")
    with open(os.path.join(args.adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise SystemExit("error: rank_pattern / alpha_pattern are not supported here")
    scaling = lora_scaling(cfg)
    ad = load_file(os.path.join(args.adapter_dir, "adapter_model.safetensors"))
    counts = {"conv1d": 0, "linear": 0}
    with torch.no_grad():
        for k, a in ad.items():
            if not k.endswith(".lora_A.weight"):
                continue
            m = k[len("base_model.model."): -len(".lora_A.weight")]
            b = ad[k.replace("lora_A", "lora_B")]
            delta = (b.float() @ a.float()) * scaling  # (out, in)
            module = model.get_submodule(m)
            kind = lora_layer_kind(module)
            if kind is None:
                raise SystemExit(f"error: {m} is a {type(module).__name__}, not a Conv1D or nn.Linear")
            if cfg.get("fan_in_fan_out") != (kind == "conv1d"):  # PEFT warns and goes by the layer's type
                print(f"warning: {m} is {kind} but fan_in_fan_out is {cfg.get('fan_in_fan_out')!r}; merged as PEFT "
                      f"does, by the layer's type", file=sys.stderr)
            counts[kind] += 1
            # Conv1D (fan_in_fan_out true): W (in, out) += delta^T; nn.Linear: W (out, in) += delta.
            module.weight += delta.T if kind == "conv1d" else delta
        # modules_to_save replace their module's parameters. PEFT wraps each listed module with its own copy, so a
        # parameter tied to another (GPT-2's and Qwen2's lm_head and token embedding) is untied first when any name
        # of its group is listed; when all are listed with equal tensors this is the same as setting the shared one.
        replaced = {k[len("base_model.model."):]: t for k, t in ad.items()
                    if ".lora_A." not in k and ".lora_B." not in k and not k.endswith(TOKENS_DELTA)}
        for names in tied_groups(model):
            if not any(n in replaced for n in names):
                continue
            listed = [n for n in names if n in replaced]
            if len(listed) > 1 and not all(torch.equal(replaced[n], replaced[listed[0]]) for n in listed):
                print(f"note: the adapter's {', '.join(listed)} differ; untied here", file=sys.stderr)
            for n in names:
                owner, pname = n.rsplit(".", 1)
                mod = model.get_submodule(owner)
                setattr(mod, pname, torch.nn.Parameter(getattr(mod, pname).detach().clone()))
        for name, t in replaced.items():
            try:
                p = model.get_parameter(name)
            except AttributeError:
                raise SystemExit(f"error: base_model.model.{name} names no parameter of the base")
            if p.shape != t.shape:
                raise SystemExit(f"error: base_model.model.{name} is {tuple(t.shape)}, the base's {tuple(p.shape)}")
            p.copy_(t)
        # trainable tokens: the rows' values replace the embedding's rows (in place: a head tied to it follows,
        # as PEFT ties its token adapter to the tied head).
        rows = 0
        for k, t in ad.items():
            if k.endswith(TOKENS_DELTA):
                weight = model.get_submodule(k[len("base_model.model."): -len(TOKENS_DELTA)]).weight
                ids = torch.tensor(token_indices(cfg))
                weight.index_copy_(0, ids, t.to(weight.dtype))
                rows += len(ids)
    print(f"merged {counts['conv1d']} Conv1D and {counts['linear']} nn.Linear adapters (scaling {scaling:g}), "
          f"replaced {len(replaced)} modules_to_save tensors and {rows} trainable token rows")
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
    if getattr(base.config, "tie_word_embeddings", False):  # a tied model stays tied, as ours is
        tied = merged.get_input_embeddings().weight.data_ptr() == merged.get_output_embeddings().weight.data_ptr()
        print(f"merged model's input and output embeddings tied: {tied}")
        ok = tied and ok
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
    m.add_argument("--family", choices=("gpt2", "llama", "qwen2", "llama3"), default="gpt2")
    c = sub.add_parser("check-hf")
    c.add_argument("export_dir")
    c.add_argument("ids")
    c.add_argument("expected")
    c.add_argument("--tol", type=float, default=1e-4)
    c.add_argument("--expect-class", choices=CAUSAL_LM_CLASSES)
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
        if args.family == "gpt2":
            make(args.out_dir)
        else:
            make_llama_family(args.out_dir, args.family)
        return 0
    return {"check-hf": check_hf, "check-adapter": check_adapter, "peft-logits": peft_logits,
            "manual-merge": manual_merge, "peft-convention": peft_convention}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
