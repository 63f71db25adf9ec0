#!/usr/bin/env python3
"""Writes a synthetic Hugging Face model directory: config.json and safetensors weights of a chosen shape,
with random values, using the Python standard library only (no PyTorch, no numpy).

  python3 scripts/make_hf_model.py --shape tinyllama-1.1b OUT
  python3 scripts/make_hf_model.py --shape llama --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 512 OUT

For benchmarks and for anyone checking the memory figures of docs/performance.md: the files have the
names, shapes, dtype and layout that transformers' save_pretrained writes for these models (one
model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json when the
tensors exceed --max-shard-size, 5 GB by default as in transformers). The values are random (each weight
a random sign and mantissa with a magnitude in [2^-7, 2^-5), norms 1): the model computes, it has
learned nothing. The same --seed writes the same bytes.

Shapes (the public models' config.json values): gpt2 (124M), tinyllama-1.1b, llama-3.2-1b,
llama-3.2-3b, qwen2-0.5b, llama-3-8b; or a family (gpt2, llama, qwen2) with every size given.
"""
import argparse
import json
import os
import random
import struct
import sys
import time

SHAPES = {
    "gpt2": dict(family="gpt2", hidden=768, layers=12, heads=12, vocab=50257, context=1024),
    "tinyllama-1.1b": dict(family="llama", hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000,
                           context=2048, tie=False, rope_theta=10000.0),
    "llama-3.2-1b": dict(family="llama", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256,
                         context=131072, tie=True, rope_theta=500000.0, llama3_rope=True),
    "llama-3.2-3b": dict(family="llama", hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256,
                         context=131072, tie=True, rope_theta=500000.0, llama3_rope=True),
    "llama-3-8b": dict(family="llama", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                       context=8192, tie=False, rope_theta=500000.0),
    "qwen2-0.5b": dict(family="qwen2", hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936,
                       context=32768, tie=True, rope_theta=1000000.0, eps=1e-6),
}
DTYPES = {"bf16": ("BF16", 2, "bfloat16"), "f16": ("F16", 2, "float16"), "f32": ("F32", 4, "float32")}


def parse_size(text):
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def tensors_of(s):
    """(name, shape, kind) in transformers' order; kind: weight, norm or bias."""
    out = []
    L, C, V = s["layers"], s["hidden"], s["vocab"]
    if s["family"] == "gpt2":
        F = 4 * C
        out += [("transformer.wte.weight", [V, C], "weight"), ("transformer.wpe.weight", [s["context"], C], "weight")]
        for i in range(L):
            p = f"transformer.h.{i}."
            out += [(p + "ln_1.weight", [C], "norm"), (p + "ln_1.bias", [C], "bias"),
                    (p + "attn.c_attn.weight", [C, 3 * C], "weight"), (p + "attn.c_attn.bias", [3 * C], "bias"),
                    (p + "attn.c_proj.weight", [C, C], "weight"), (p + "attn.c_proj.bias", [C], "bias"),
                    (p + "ln_2.weight", [C], "norm"), (p + "ln_2.bias", [C], "bias"),
                    (p + "mlp.c_fc.weight", [C, F], "weight"), (p + "mlp.c_fc.bias", [F], "bias"),
                    (p + "mlp.c_proj.weight", [F, C], "weight"), (p + "mlp.c_proj.bias", [C], "bias")]
        out += [("transformer.ln_f.weight", [C], "norm"), ("transformer.ln_f.bias", [C], "bias")]
        return out
    H, KV, F = s["heads"], s["kv_heads"], s["intermediate"]
    D = C // H
    bias = s["family"] == "qwen2"
    out.append(("model.embed_tokens.weight", [V, C], "weight"))
    for i in range(L):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", [C], "norm"))
        for proj, rows in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)):
            out.append((p + f"self_attn.{proj}.weight", [rows, C], "weight"))
            if bias:
                out.append((p + f"self_attn.{proj}.bias", [rows], "bias"))
        out += [(p + "self_attn.o_proj.weight", [C, H * D], "weight"),
                (p + "post_attention_layernorm.weight", [C], "norm"),
                (p + "mlp.gate_proj.weight", [F, C], "weight"), (p + "mlp.up_proj.weight", [F, C], "weight"),
                (p + "mlp.down_proj.weight", [C, F], "weight")]
    out.append(("model.norm.weight", [C], "norm"))
    if not s.get("tie", True):
        out.append(("lm_head.weight", [V, C], "weight"))
    return out


def config_of(s, dtype):
    torch_dtype = DTYPES[dtype][2]
    if s["family"] == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": s["vocab"],
                "n_positions": s["context"], "n_embd": s["hidden"], "n_layer": s["layers"], "n_head": s["heads"],
                "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "bos_token_id": 50256, "eos_token_id": 50256, "torch_dtype": torch_dtype}
    qwen = s["family"] == "qwen2"
    c = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": s["family"],
         "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["intermediate"],
         "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
         "max_position_embeddings": s["context"], "rms_norm_eps": s.get("eps", 1e-5), "rope_theta": s["rope_theta"],
         "hidden_act": "silu", "tie_word_embeddings": s.get("tie", True), "torch_dtype": torch_dtype}
    if not qwen:
        c["attention_bias"] = False
        c["mlp_bias"] = False
    else:
        c["use_sliding_window"] = False
    if s.get("llama3_rope"):
        c["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}
    return c


class Values:
    """Random little-endian values of one dtype, in chunks: weights of magnitude [2^-7, 2^-5) with random
    sign and mantissa (the high byte of each 16-bit value fixed by a translation table: C speed), ones."""

    def __init__(self, dtype, seed):
        self.dtype = dtype
        self.rng = random.Random(seed)
        if dtype == "f16":  # sign | exponent 8 or 9 (bias 15) | 2 mantissa bits
            self.table = bytes((b & 0x80) | ((8 + ((b >> 2) & 1)) << 2) | (b & 3) for b in range(256))
        else:  # bf16: sign | the exponent's high 7 bits of 120 or 121 (bias 127); the low byte holds the rest
            self.table = bytes((b & 0x80) | 0x3C for b in range(256))

    def weights(self, n):
        buf = bytearray(self.rng.randbytes(2 * n))
        buf[1::2] = bytes(buf[1::2]).translate(self.table)
        if self.dtype == "f32":  # the bf16 values, exactly, as float32: two zero bytes below each
            out = bytearray(4 * n)
            out[2::4] = buf[0::2]
            out[3::4] = buf[1::2]
            return out
        return buf

    def ones(self, n):
        one = {"bf16": b"\x80\x3f", "f16": b"\x00\x3c", "f32": b"\x00\x00\x80\x3f"}[self.dtype]
        return one * n


def write_file(path, entries, values, chunk):
    """entries: (name, shape, kind); writes a .safetensors file, streaming each tensor in chunks."""
    tag, size, _ = DTYPES[values.dtype]
    header, at = {}, 0
    for name, shape, kind in entries:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [at, at + n * size]}
        at += n * size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, kind in entries:
            n = 1
            for d in shape:
                n *= d
            while n > 0:
                k = min(n, chunk)
                f.write(values.ones(k) if kind == "norm" else values.weights(k))
                n -= k
    os.replace(tmp, path)
    return at


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("out", help="directory to write (created; an existing config.json or weights in it are replaced)")
    ap.add_argument("--shape", default="tinyllama-1.1b", help="one of " + ", ".join(SHAPES) + ", or gpt2/llama/qwen2 with sizes")
    for k in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "context"):
        ap.add_argument("--" + k, type=int, help="override the shape's " + k)
    ap.add_argument("--tie", choices=["true", "false"], help="override whether the output head is the token embedding (llama)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the weights' dtype (default bf16)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest file before sharding, as transformers (default 5GB)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.shape in SHAPES:
        s = dict(SHAPES[a.shape])
    elif a.shape in ("llama", "qwen2", "gpt2"):
        s = dict(family=a.shape, context=2048, rope_theta=10000.0, tie=a.shape != "llama")
        if a.shape == "gpt2":
            s["context"] = 1024
    else:
        sys.exit(f"make_hf_model.py: unknown --shape {a.shape!r}; one of {', '.join(SHAPES)}, gpt2, llama, qwen2")
    for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "context"):
        v = getattr(a, k)
        if v is not None:
            if v <= 0:
                sys.exit(f"make_hf_model.py: --{k.replace('_', '-')} must be positive")
            s[k] = v
    if a.tie is not None:
        s["tie"] = a.tie == "true"
    need = ["layers", "hidden", "heads", "vocab"] + ([] if s["family"] == "gpt2" else ["intermediate"])
    missing = [k for k in need if k not in s]
    if missing:
        sys.exit("make_hf_model.py: --shape " + a.shape + " needs " + " ".join("--" + k for k in missing))
    s.setdefault("kv_heads", s["heads"])
    if s["hidden"] % s["heads"] or s["heads"] % s["kv_heads"]:
        sys.exit("make_hf_model.py: --heads must divide --hidden, and --kv-heads must divide --heads")

    os.makedirs(a.out, exist_ok=True)
    entries = tensors_of(s)
    size = DTYPES[a.dtype][1]
    limit = parse_size(a.max_shard_size)
    shards, current, current_bytes = [], [], 0
    for e in entries:
        n = size
        for d in e[1]:
            n *= d
        if current and current_bytes + n > limit:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(e)
        current_bytes += n
    shards.append(current)
    for old in os.listdir(a.out):
        if old.endswith(".safetensors") or old == "model.safetensors.index.json":
            os.remove(os.path.join(a.out, old))
    values = Values(a.dtype, a.seed)
    t0, total, weight_map = time.time(), 0, {}
    for i, part in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(os.path.join(a.out, name), part, values, chunk=1 << 24)
        for e in part:
            weight_map[e[0]] = name
    if len(shards) > 1:
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config_of(s, a.dtype), f, indent=2)
    params = total // size
    count = f"{params / 1e9:.3f}B" if params >= 1e8 else f"{params / 1e6:.3f}M"
    print(f"wrote {a.out}: {s['family']} ({a.shape}), {count} parameters, {total / 1e9:.2f} GB of {a.dtype} "
          f"in {len(shards)} file{'s' if len(shards) > 1 else ''}, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
