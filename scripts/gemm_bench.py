#!/usr/bin/env python3
"""The f32 products of a linear layer on the CPU, OpenBLAS's sgemm (PyTorch's mm) beside oneDNN's
(dnnl_sgemm, through ctypes), for the bench model's weights (configs/bench_block256.json: d 384, MLP
1,536, vocabulary 50,257; or those of --weights) and 1,024 tokens (--tokens): the forward x W^T, x's gradient g W and W's gradient g^T x.
Each figure is the lower quartile of N calls, the best of 3 rounds. It is what kernels/cpu_gemm.hpp's
choice rests on (docs/performance.md, "oneDNN's sgemm").

    /usr/bin/python3 scripts/gemm_bench.py [--tokens 1024] [--threads 2] [--weights 2048x2048,...] [--out gemm.json]

Needs Debian's python3-torch and libdnnl (which Debian's LibTorch links). ONEDNN_MAX_CPU_ISA=AVX2 and
OPENBLAS_CORETYPE=Haswell make both libraries use their AVX2 kernels on an AVX-512 CPU.
"""
import argparse
import ctypes
import ctypes.util
import json
import platform
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="1152x384,384x384,1536x384,384x1536,50257x384",
                    help="the weights' shapes, out x in, comma-separated (default: the GPT bench model's; "
                         "configs/bench_llama.json's: 2048x2048,512x2048,8192x2048,2048x8192,128256x2048)")
    ap.add_argument("--out", default="gemm.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    name = ctypes.util.find_library("dnnl") or "libdnnl.so.2"
    sgemm = ctypes.CDLL(name).dnnl_sgemm
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    sgemm.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]

    def onednn(ta, tb, M, N, K, A, lda, B, ldb, C):
        status = sgemm(ta, tb, M, N, K, 1.0, A.data_ptr(), lda, B.data_ptr(), ldb, 0.0, C.data_ptr(), N)
        assert status == 0, status

    def quartile(fn, n):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 4] * 1e3

    T = a.tokens
    rows = []
    for out, inp in [tuple(int(v) for v in w.split("x")) for w in a.weights.split(",")]:
        X, W, G = torch.randn(T, inp), torch.randn(out, inp), torch.randn(T, out)
        Y, dX, dW = torch.empty(T, out), torch.empty(T, inp), torch.empty(out, inp)
        n = 5 if out > 10000 else 30
        cases = [
            ("forward x W^T", lambda: torch.mm(X, W.t(), out=Y),
             lambda: onednn(b"N", b"T", T, out, inp, X, inp, W, inp, Y)),
            ("x's gradient g W", lambda: torch.mm(G, W, out=dX),
             lambda: onednn(b"N", b"N", T, inp, out, G, out, W, inp, dX)),
            ("W's gradient g^T x", lambda: torch.mm(G.t(), X, out=dW),
             lambda: onednn(b"T", b"N", out, inp, T, G, out, X, inp, dW)),
        ]
        for what, openblas_fn, onednn_fn in cases:
            best = [min(quartile(f, n) for _ in range(3)) for f in (openblas_fn, onednn_fn)]
            rows.append({"weight": [out, inp], "product": what, "openblas_ms": best[0], "onednn_ms": best[1]})
            print(f"W {out:>5} x {inp:<5} {what:19s} OpenBLAS {best[0]:8.2f} ms   oneDNN {best[1]:8.2f} ms   "
                  f"OpenBLAS / oneDNN {best[0] / best[1]:.2f}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"tokens": T, "threads": a.threads, "cpu": platform.processor(), "torch": torch.__version__,
                   "onednn_library": name, "products": rows}, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
