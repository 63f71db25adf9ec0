#!/usr/bin/python3
"""The comparison a user would make: the same model and the same two-phase scheme written as an ordinary
plain-PyTorch script (on the CPU: Debian's python3-torch, the same LibTorch 1.13 as lora_trainer), timed
the same way. Phase 2 applies LoRA either as the reference framework does (--lora merged: every step it
forms W + (alpha/r) (A B)^T and runs the layer with the merged weight) or as a knowledgeable user writes it
(--lora unmerged, the default: F.linear(x, W) + (alpha/r) (x A) B, as PEFT does).

Usage: scripts/reference_gpt.py BENCH_JSON [--device cpu|cuda] [--steps N] [--warmup N] [--out FILE]
BENCH_JSON is what `lora_trainer bench CONFIG --weights-out W.pt --out BENCH_JSON` wrote: the resolved
config (model, batch, optimizer, threads) and, in W.pt, the initial weights and a check batch. The
script first checks that its loss on that batch from those weights equals lora_trainer's (within bf16
tolerance), then times phase 1 and phase 2 and writes its figures as JSON.

The model is the bench config's family: GPT-2 (`architecture/family=gpt2`) or the llama family
(Llama, Qwen2, Mistral) as transformers' modeling_llama writes it: RMSNorm in f32, rotary positions
(rotate_half, with the llama3 or linear frequency scaling), grouped-query attention (the key/value heads
repeated for their query heads, repeat_kv; under SDPA PyTorch 2.5's enable_gqa), SwiGLU, biases on q/k/v
where the config has them (Qwen2), the head tied to the embedding or not. With
optimization/lora/quantize_base=nf4 the LoRA phase keeps the blocks' matrices as 4-bit NormalFloat
(bitsandbytes' levels, blocks of 64, an f32 absmax each, two codes a byte) dequantized in plain PyTorch
for every product: QLoRA on a machine without bitsandbytes' kernels.

What it uses, as a plain PyTorch user would write it:
- --device cpu (the default): bf16 autocast on the CPU (when the bench ran in bf16), attention as an
  explicit masked softmax, torch.optim.AdamW with its defaults (on PyTorch 1.13's CPU: the per-tensor
  loop; --adamw foreach for the multi-tensor one). When the bench ran in f32 (a CPU without fast bf16),
  the frozen base of phase 2 stays f32: the fastest a user can do there (lora_trainer keeps it bf16 and
  casts per product). scripts/bench.sh runs it with glibc's allocator tuned as lora_trainer's runtime
  tunes it (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so that the comparison is of the code.
- --device cuda (PyTorch 2.x): the weights and batches on the GPU, torch.autocast("cuda",
  dtype=torch.bfloat16) over f32 weights, attention through F.scaled_dot_product_attention(
  is_causal=True) (flash / memory-efficient kernels) where PyTorch has it (--attention manual for the
  masked softmax), torch.optim.AdamW with its defaults (on CUDA: the multi-tensor foreach
  implementation; --adamw fused for fused=True) and clip_grad_norm_ (foreach); random token batches
  made on the GPU; torch.cuda.synchronize() before and after every timed step. It also measures the
  GPU's bf16 matmul peak (8192^3) for MFU. --pad-vocab computes the head over the vocabulary rounded
  up to a multiple of 64, as lora_trainer does on CUDA, so that change can be measured apart.
- --compile (PyTorch 2.x): the forward and loss under torch.compile (default mode; Inductor's generated
  kernels fuse the elementwise work), compiled in the warm-up steps (each phase compiles anew: the
  frozen bf16 base and the adapters change the graph), so the timed steps are the compiled ones. With
  --adamw fused this is the strongest plain script we know of.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F


def layer_norm(x, w, b):
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), 1e-5)


NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


class NF4Weight:
    """A frozen weight in 4-bit NormalFloat as a plain script holds it (bitsandbytes' format without its
    kernels): two codes a byte, an f32 absmax per block of 64, dequantized for every product."""

    def __init__(self, w, block=64):
        self.shape, self.block = w.shape, block
        blocks = w.detach().float().reshape(-1, block)
        self.absmax = blocks.abs().amax(1).clamp_min(1e-12)
        levels = torch.tensor(NF4_LEVELS, device=w.device)
        codes = ((blocks / self.absmax[:, None]).unsqueeze(-1) - levels).abs().argmin(-1).to(torch.uint8).reshape(-1, 2)
        self.packed = (codes[:, 0] << 4) | codes[:, 1]
        self.levels = levels

    def dequantize(self, dtype):
        codes = torch.stack([self.packed >> 4, self.packed & 15], -1).reshape(-1, self.block).long()
        return (self.levels[codes] * self.absmax[:, None]).reshape(self.shape).to(dtype)

    def dim(self):
        return len(self.shape)


class Functional:
    """Parameters in a dict named as lora_trainer names them; a functional forward. The frozen base of
    phase 2 may be NF4Weight's."""

    def __init__(self, params, sdpa=False, pad_vocab=False, merged=False):
        self.p = params
        self.lora = {}  # weight name -> (A, B)
        self.scale = 0.0
        self.sdpa = sdpa  # F.scaled_dot_product_attention(is_causal=True) instead of the masked softmax
        self.pad_vocab = pad_vocab  # the head over V rounded up to 64 columns, as lora_trainer does on CUDA
        self.merged = merged  # phase 2: merge the adapters into the weight every step (else beside it)

    def weight(self, name):
        w = self.p[name]
        autocast = torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
        if isinstance(w, NF4Weight):
            w = w.dequantize(torch.bfloat16 if autocast else torch.float32)
        if name in self.lora and self.merged:  # the reference framework's way: merge every step
            A, B = self.lora[name]
            w = w.float() + self.scale * (A @ B).t()
        elif w.dtype != torch.float32 and not autocast:
            w = w.float()
        return w

    def linear(self, x, prefix):
        name = prefix + ".weight"
        y = F.linear(x, self.weight(name), self.p.get(prefix + ".bias"))
        if name in self.lora and not self.merged:  # PEFT's way: the adapters beside the frozen layer
            A, B = self.lora[name]
            y = y + self.scale * ((x @ A) @ B)
        return y

    def attention(self, q, k, v, mask):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = torch.softmax(att.masked_fill(mask, float("-inf")).float(), -1).to(v.dtype)
        return att @ v

    def head_loss(self, x, W, targets):
        if self.pad_vocab and W.shape[0] % 64:
            V, Vp = W.shape[0], (W.shape[0] + 63) // 64 * 64
            bias = torch.zeros(Vp, device=W.device)
            bias[V:] = float("-inf")
            logits = F.linear(x, torch.cat([W, W.new_zeros(Vp - V, W.shape[1])]), bias)
        else:
            logits = F.linear(x, W)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


class GPT(Functional):
    """GPT-2: learned positions, LayerNorm, GELU MLP, the head tied to the embedding."""

    def __init__(self, cfg, params, **kw):
        super().__init__(params, **kw)
        a = cfg["architecture"]
        self.L, self.H, self.C, self.T = a["n_layers"], a["n_heads"], a["d_model"], a["block_size"]

    def is_block_matrix(self, name):
        return name.startswith("h.")

    def head_name(self):
        return "wte.weight"

    def loss(self, idx, targets):
        B, T = idx.shape
        p = self.p
        x = p["wte.weight"][idx].float() + p["wpe.weight"][:T].float()
        mask = None if self.sdpa else torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
        for i in range(self.L):
            h = f"h.{i}."
            y = layer_norm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
            qkv = self.linear(y, h + "attn.c_attn").view(B, T, 3, self.H, self.C // self.H).permute(2, 0, 3, 1, 4)
            y = self.attention(qkv[0], qkv[1], qkv[2], mask)
            y = y.transpose(1, 2).reshape(B, T, self.C)
            x = x + self.linear(y, h + "attn.c_proj").float()
            y = layer_norm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
            y = F.gelu(self.linear(y, h + "mlp.c_fc"))
            x = x + self.linear(y, h + "mlp.c_proj").float()
        x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
        return self.head_loss(x, self.weight("wte.weight"), targets)


def rope_inv_freq(a, head_dim):
    """transformers' default and llama3 rotary frequencies (modeling_rope_utils)."""
    inv = 1.0 / (a["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if a["rope_scaling"] == "linear":
        return inv / a["rope_factor"]
    if a["rope_scaling"] == "llama3":
        factor, low, high, ctx = a["rope_factor"], a["rope_low_freq_factor"], a["rope_high_freq_factor"], a["rope_original_context"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > ctx / low, inv / factor, inv)
        smooth = (ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= ctx / high) & (wavelen <= ctx / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def has_gqa_sdpa():
    """F.scaled_dot_product_attention takes enable_gqa from PyTorch 2.5."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return hasattr(F, "scaled_dot_product_attention") and (major, minor) >= (2, 5)


class Llama(Functional):
    """Llama / Qwen2 / Mistral as transformers' modeling_llama writes them: RMSNorm, rotary positions,
    grouped-query attention (the key/value heads repeated for their query heads, repeat_kv; with SDPA
    PyTorch 2.5's enable_gqa), SwiGLU, a head tied to the embedding or not."""

    def __init__(self, cfg, params, **kw):
        super().__init__(params, **kw)
        a = cfg["architecture"]
        self.L, self.H, self.C, self.T = a["n_layers"], a["n_heads"], a["d_model"], a["block_size"]
        self.KV = a["n_kv_heads"] if a["n_kv_heads"] > 0 else self.H
        self.eps = a["norm_eps"]
        self.act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[a["activation"]]
        D = self.C // self.H
        device = next(iter(params.values())).device
        angles = torch.arange(self.T, dtype=torch.float32)[:, None] * rope_inv_freq(a, D)[None, :]
        emb = torch.cat((angles, angles), -1).to(device)
        self.cos, self.sin = emb.cos(), emb.sin()

    def is_block_matrix(self, name):
        return name.startswith("model.layers.")

    def head_name(self):
        return "lm_head.weight" if "lm_head.weight" in self.p else "model.embed_tokens.weight"

    def rope(self, t, cos, sin):
        t = t.float()
        return t * cos + rotate_half(t) * sin

    def rms_norm(self, x, w):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()

    def loss(self, idx, targets):
        B, T = idx.shape
        H, KV, D = self.H, self.KV, self.C // self.H
        p = self.p
        x = F.embedding(idx, p["model.embed_tokens.weight"]).float()
        cos, sin = self.cos[:T], self.sin[:T]
        mask = None if self.sdpa else torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
        for i in range(self.L):
            h = f"model.layers.{i}."
            y = self.rms_norm(x, p[h + "input_layernorm.weight"])
            q = self.linear(y, h + "self_attn.q_proj").view(B, T, H, D).transpose(1, 2)
            k = self.linear(y, h + "self_attn.k_proj").view(B, T, KV, D).transpose(1, 2)
            v = self.linear(y, h + "self_attn.v_proj").view(B, T, KV, D).transpose(1, 2)
            q, k = self.rope(q, cos, sin).to(v.dtype), self.rope(k, cos, sin).to(v.dtype)
            if self.sdpa and KV != H and has_gqa_sdpa():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                if KV != H:  # repeat_kv
                    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
                y = self.attention(q, k, v, mask)
            y = y.transpose(1, 2).reshape(B, T, self.C)
            x = x + self.linear(y, h + "self_attn.o_proj").float()
            y = self.rms_norm(x, p[h + "post_attention_layernorm.weight"])
            y = self.act(self.linear(y, h + "mlp.gate_proj")) * self.linear(y, h + "mlp.up_proj")
            x = x + self.linear(y, h + "mlp.down_proj").float()
        x = self.rms_norm(x, p["model.norm.weight"])
        return self.head_loss(x, self.weight(self.head_name()), targets)


def make_model(cfg, params, **kw):
    return (Llama if cfg["architecture"].get("family", "gpt2") == "llama" else GPT)(cfg, params, **kw)


def batch_and_micro(cfg):
    """The step's rows and the rows of a micro-batch (per_device_batch_size < 0: the whole batch at once)."""
    t = cfg["training"]
    return t["batch_size"], t["batch_size"] if t["per_device_batch_size"] < 0 else t["per_device_batch_size"]


def make_step(model, params, cfg, lr, weight_decay, device="cpu", fused="default"):
    o = cfg["optimization"]
    B, micro = batch_and_micro(cfg)
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    extra = {"fused": True} if fused == "fused" else {"foreach": True} if fused == "foreach" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(o["beta1"], o["beta2"]), eps=o["eps"], **extra)
    V, T = cfg["architecture"]["vocab_size"], cfg["architecture"]["block_size"]
    cuda = device != "cpu"

    def step():
        window = torch.randint(0, V, (B, T + 1), device=device) if cuda else torch.randint(0, V, (B, T + 1))
        opt.zero_grad(set_to_none=True)
        n = B * T
        total = 0.0
        for first in range(0, B, micro):
            chunk = window[first:first + micro]
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = model.loss(chunk[:, :-1], chunk[:, 1:]) / n
            loss.backward()
            # On the GPU the loss stays there (reading it would wait for the GPU every micro-batch).
            total = total + (loss.detach() if cuda else loss.item())
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip"])
        opt.step()
        return total

    return step


def sync():
    if device_type == "cuda":
        torch.cuda.synchronize()


def timed(step, warmup, steps):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times


def products_time(model, cfg, lora, device, reps=3):
    """Seconds a step of the phase spends in its matrix products alone: every product of the forward and
    backward (phase 1: each weight's forward, x's and W's gradients; the LoRA phase: the frozen weights'
    forward and x's gradient, the adapters' six products), attention's two batched products forward and
    four backward, for every micro-batch, on random operands of the step's shapes and dtype. No program
    that computes this step with this BLAS/oneDNN can take less time: the reference's step time over
    this is the most any implementation could gain on it."""
    B, micro = batch_and_micro(cfg)
    T, H, D = model.T, model.H, model.C // model.H
    dt = torch.bfloat16 if bf16 else torch.float32
    N = micro * T

    def mk(*shape):
        return torch.randn(*shape, device=device, dtype=dt)

    ops = []
    for name, w in model.p.items():
        if w.dim() != 2 or not (model.is_block_matrix(name) or name == model.head_name()):
            continue
        out, inp = w.shape
        W, x, g = mk(out, inp), mk(N, inp), mk(N, out)
        ops += [lambda x=x, W=W: F.linear(x, W), lambda g=g, W=W: g.mm(W)]
        if not lora:
            ops.append(lambda g=g, x=x: g.t().mm(x))
        elif name in model.lora:
            r = model.lora[name][0].shape[1]
            A, Bm, xa, gb = mk(inp, r), mk(r, out), mk(N, r), mk(N, r)
            ops += [lambda x=x, A=A: x.mm(A), lambda xa=xa, Bm=Bm: xa.mm(Bm), lambda g=g, Bm=Bm: g.mm(Bm.t()),
                    lambda xa=xa, g=g: xa.t().mm(g), lambda gb=gb, A=A: gb.mm(A.t()), lambda x=x, gb=gb: x.t().mm(gb)]
    q, k, v, dy = mk(micro * H, T, D), mk(micro * H, T, D), mk(micro * H, T, D), mk(micro * H, T, D)
    att, datt = mk(micro * H, T, T), mk(micro * H, T, T)
    for _ in range(model.L):
        ops += [lambda: q @ k.transpose(-2, -1), lambda: att @ v,  # forward
                lambda: att.transpose(-2, -1) @ dy, lambda: dy @ v.transpose(-2, -1),  # v's and the weights' gradients
                lambda: datt @ k, lambda: datt.transpose(-2, -1) @ q]  # q's and k's gradients

    def step():
        for _ in range(0, B, micro):
            for op in ops:
                op()
        sync()

    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def cuda_matmul_peak(n=8192, reps=10):
    """The best bf16 (n x n) @ (n x n) rate on the GPU, FLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2.0 * n ** 3 / best


def load_weights(path, device):
    try:  # PyTorch 2.6+ loads weights_only by default; these are plain tensors in a dict
        return torch.load(path, map_location=device, weights_only=False)
    except TypeError:  # a PyTorch without weights_only
        return torch.load(path, map_location=device)


def main():
    global bf16, device_type
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--attention", choices=["auto", "sdpa", "manual"], default="auto",
                    help="auto: F.scaled_dot_product_attention on CUDA where PyTorch has it, else the masked softmax")
    ap.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default",
                    help="torch.optim.AdamW as constructed by default, with foreach=True, or with fused=True (CUDA)")
    ap.add_argument("--lora", choices=["merged", "unmerged"], default="unmerged",
                    help="phase 2's adapters beside the frozen layer (PEFT's way, the default) or merged into its "
                         "weight every step (the reference framework's way)")
    ap.add_argument("--pad-vocab", action="store_true",
                    help="the head over the vocabulary rounded up to a multiple of 64 (extra columns at -inf), "
                         "as lora_trainer does on CUDA: separates that change from the rest of the comparison")
    ap.add_argument("--compile", action="store_true",
                    help="the forward and loss under torch.compile (PyTorch 2.x), compiled during the warm-up steps")
    ap.add_argument("--products", action="store_true",
                    help="also time each phase's matrix products alone (products_s): the floor no implementation "
                         "on this BLAS can go under, so the most any could gain on the reference")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="reference.json")
    args = ap.parse_args()
    bench = json.load(open(args.bench_json))
    cfg = bench["resolved_config"]
    check = bench.get("first_batch_check")
    if not check:
        sys.exit(f"{args.bench_json} has no first_batch_check: run lora_trainer bench with --weights-out")
    device_type = args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    device = torch.device(device_type)
    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    if args.attention == "sdpa" and not has_sdpa:
        sys.exit(f"--attention sdpa: PyTorch {torch.__version__} has no F.scaled_dot_product_attention")
    sdpa = args.attention == "sdpa" or (args.attention == "auto" and device_type == "cuda" and has_sdpa)
    torch.set_num_threads(bench["threads"])
    bf16 = bench["precision"].startswith("bf16")
    state = load_weights(check["weights"], device)
    params = {k: v.detach().clone().to(device).requires_grad_(True) for k, v in state.items() if not k.startswith("check/")}
    model = make_model(cfg, params, sdpa=sdpa, pad_vocab=args.pad_vocab, merged=args.lora == "merged")

    with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        inputs, targets = state["check/inputs"].to(device), state["check/targets"].to(device)
        ref_loss = (model.loss(inputs, targets) / targets.numel()).item()
    diff = abs(ref_loss - check["loss"])
    print(f"first-batch loss from the same weights: lora_trainer {check['loss']:.5f}, reference {ref_loss:.5f}, |diff| {diff:.2e}")
    if diff > 0.02:
        sys.exit("the reference does not compute what lora_trainer computes (|diff| > 0.02): not a like-for-like comparison")

    if args.compile:
        if not hasattr(torch, "compile"):
            sys.exit(f"--compile: PyTorch {torch.__version__} has no torch.compile (2.0 or later has)")
        if args.warmup < 1:
            sys.exit("--compile needs --warmup 1 or more: the first steps of each phase compile")
        model.loss = torch.compile(model.loss)  # the instance's attribute shadows the method
    tps = cfg["training"]["batch_size"] * cfg["architecture"]["block_size"]
    result = {"first_batch_loss": ref_loss, "lora_trainer_first_batch_loss": check["loss"], "phases": []}
    fused = args.adamw
    result.update({"device": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu", "torch": torch.__version__,
                   "attention": "F.scaled_dot_product_attention(is_causal=True)" if sdpa else "masked softmax",
                       "pad_vocab": args.pad_vocab,
                   "adamw": {"fused": "fused=True", "foreach": "foreach=True"}.get(fused, "default"),
                   "lora": args.lora, "precision": "bf16 autocast" if bf16 else "f32",
                   "compiled": "torch.compile (default mode)" if args.compile else "eager"})
    if device_type == "cuda":
        result["gpu_bf16_matmul_peak_tflops"] = cuda_matmul_peak() / 1e12
        print(f"GPU bf16 matmul peak (8192^3): {result['gpu_bf16_matmul_peak_tflops']:.0f} TFLOP/s")
    # Phase 1: every parameter trains.
    step = make_step(model, list(params.values()), cfg, cfg["optimization"]["lr"], cfg["optimization"]["weight_decay"],
                     device, fused)
    t0 = time.perf_counter()
    times = timed(step, args.warmup, args.steps)
    print(f"phase 1: warm-up and timed steps {time.perf_counter() - t0:.1f} s")
    result["phases"].append({"phase": "full", "tokens_per_s": tps / times[len(times) // 2], "step_s_median": times[len(times) // 2],
                             "step_s_min": times[0], "step_s_max": times[-1]})
    if args.products:
        result["phases"][-1]["products_s"] = products_time(model, cfg, False, device)
    # Phase 2: freeze the base as bf16, adapters on the targets, merged every step.
    lcfg = cfg["optimization"]["lora"]
    r, alpha = lcfg["rank"], lcfg["alpha"]
    for k in params:  # f32 runs (no fast bf16) keep the base f32: casting per product would only cost time
        params[k] = params[k].detach().to(torch.bfloat16 if bf16 else torch.float32)
    nf4 = lcfg.get("quantize_base", "bf16") == "nf4"
    if nf4:  # QLoRA: the blocks' matrices as 4-bit NF4, dequantized for every product
        for k, w in params.items():
            if w.dim() == 2 and model.is_block_matrix(k):
                params[k] = NF4Weight(w)
    result["lora_base"] = "nf4 (dequantized per product in plain PyTorch)" if nf4 else ("bf16" if bf16 else "f32")
    model.p = params
    model.scale = alpha / r
    adapters = []
    targets = lcfg["target_modules"]
    for k, w in params.items():
        # "all-linear" (the default): every block's matrix, as PEFT takes it (not the embeddings, not the head)
        linear = w.dim() == 2 and model.is_block_matrix(k)
        if linear and (targets == ["all-linear"] or any(t in k for t in targets)):
            A = (torch.randn(w.shape[1], r, device=device) / r).requires_grad_(True)
            B = torch.zeros(r, w.shape[0], device=device, requires_grad=True)
            model.lora[k] = (A, B)
            adapters += [A, B]
    step = make_step(model, adapters, cfg, lcfg["lr"], lcfg["weight_decay"], device, fused)
    times = timed(step, args.warmup, args.steps)
    result["phases"].append({"phase": "lora", "tokens_per_s": tps / times[len(times) // 2], "step_s_median": times[len(times) // 2],
                             "step_s_min": times[0], "step_s_max": times[-1]})
    if args.products:
        result["phases"][-1]["products_s"] = products_time(model, cfg, True, device)
    json.dump(result, open(args.out, "w"), indent=2)
    for ph in result["phases"]:
        print(f"reference {ph['phase']:5s}: {ph['tokens_per_s']:8.0f} tok/s, step median {ph['step_s_median']:.3f}s"
              + (f"; its products alone {ph['products_s']:.3f}s (at most {ph['step_s_median'] / ph['products_s']:.2f}x "
                 "faster for any program on this BLAS)" if "products_s" in ph else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
