#!/usr/bin/env python3
"""Dump-and-diff one model between two devices: runs `turbospark logits --trace-out` on the CPU
and on CUDA with the same tokens and chunk, then prints, block by block in layer order, the
relative error of every traced activation (max |cuda - cpu| over max |cpu| of the tensor) and the
first token row where it exceeds the threshold: where a GPU path first leaves the CPU's.

    python3 tools/diff_trace.py --ts build-cuda/turbospark --model tests/data/fixtures/gpt_oss_tiny \
        [--tokens 1,2,3 | --long] [--chunk 0] [--threshold 1e-2] [--work /tmp/trace] [--precision cuda]

--precision cuda runs the CPU side rounding where CUDA does (`logits --precision cuda`): what
is left over is the GPU kernels' own error, not the bf16 the GPU path runs at.

--noise (with --precision cuda) also runs the CPU side with every matmul output nudged by 2^-22
(`logits --nudge 1`) and prints, next to each tensor's error, how far that nudge alone moved it:
the resolution of the comparison. An error of the nudge's size is summation-order noise that bf16
roundings downstream amplified, not a kernel bug.

--replay-routes (MoE, with --precision cuda) runs the CPU side routing as CUDA did (CUDA runs
first with --router-out; `logits --replay-routes`), so a near tie the two break differently does
not show as a divergence; the CPU prints how many rows it would have routed otherwise.

--long takes the fixture's long_golden.json tokens, otherwise golden.json's.
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np


def run(ts, model, device, tokens, chunk, out_dir, precision="exact", extra=None):
    """`turbospark logits` into out_dir (logits.npy and, by default, the traces); `extra` replaces
    --trace-out with other output flags (tools/router_flips.py: --router-out)."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [ts, "logits", "--model", model, "--tokens", tokens, "--chunk", str(chunk), "--device", device,
           "--out", os.path.join(out_dir, "logits.npy")] + (extra if extra is not None else ["--trace-out", out_dir])
    if device == "cpu" and precision != "exact":
        cmd += ["--precision", precision]
    env = dict(os.environ, TURBOSPARK_CUDA_UNVERIFIED="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"diff_trace: {' '.join(cmd)} failed: {p.stderr.strip()[-400:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ts", default="build-cuda/turbospark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="")
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=1e-2)
    ap.add_argument("--work", default="/tmp/diff_trace")
    ap.add_argument("--show", type=int, default=12, help="print at most this many tensors past the threshold")
    ap.add_argument("--precision", default="exact", choices=["exact", "cuda"], help="the CPU side's rounding")
    ap.add_argument("--noise", action="store_true", help="also print the CPU side's own nudge noise (--precision cuda)")
    ap.add_argument("--replay-routes", action="store_true", help="the CPU side routes as CUDA did (--precision cuda)")
    a = ap.parse_args()
    if (a.noise or a.replay_routes) and a.precision != "cuda":
        sys.exit("diff_trace: --noise and --replay-routes shape the CPU reference of CUDA: add --precision cuda")
    tokens = a.tokens
    if not tokens:
        with open(os.path.join(a.model, "long_golden.json" if a.long else "golden.json")) as fh:
            tokens = ",".join(str(t) for t in json.load(fh)["tokens"])
    cpu_dir, cuda_dir, noise_dir = (os.path.join(a.work, d) for d in ("cpu", "cuda", "noise"))
    extra_cuda, extra_cpu = [], []
    if a.replay_routes:
        routes = os.path.join(a.work, "cuda_router.npy")
        extra_cuda, extra_cpu = ["--router-out", routes], ["--replay-routes", routes]
    run(a.ts, a.model, "cuda", tokens, a.chunk, cuda_dir, extra=extra_cuda + ["--trace-out", cuda_dir])
    run(a.ts, a.model, "cpu", tokens, a.chunk, cpu_dir, a.precision, extra=extra_cpu + ["--trace-out", cpu_dir])
    if a.noise:
        run(a.ts, a.model, "cpu", tokens, a.chunk, noise_dir, a.precision,
            extra=extra_cpu + ["--nudge", "1", "--trace-out", noise_dir])

    def key(name):
        m = re.match(r"(.*)_(-?\d+)\.npy$", name)
        return (int(m.group(2)), m.group(1)) if m else (10**9, name)

    names = sorted((n for n in os.listdir(cpu_dir) if n.endswith(".npy") and n != "logits.npy"), key=key)
    names.append("logits.npy")
    shown = 0
    print(f"{os.path.basename(a.model)} tokens {len(tokens.split(','))} chunk {a.chunk} cpu precision {a.precision}")
    for n in names:
        x, y = np.load(os.path.join(cpu_dir, n)), np.load(os.path.join(cuda_dir, n))
        if x.shape != y.shape:
            print(f"  {n}: shapes differ {x.shape} vs {y.shape}")
            continue
        scale = max(float(np.abs(x).max()), 1e-30)
        row_err = np.abs(y - x).max(axis=1) / scale if x.ndim == 2 else np.abs(y - x).reshape(1, -1).max(axis=1) / scale
        err = float(np.nan_to_num(row_err, nan=np.inf).max())
        if err > a.threshold or n == "logits.npy":
            first = int(np.argmax(np.nan_to_num(row_err, nan=np.inf) > a.threshold)) if err > a.threshold else -1
            noise = ""
            if a.noise:
                z = np.load(os.path.join(noise_dir, n))
                noise = f"  (nudge noise {float(np.abs(z - x).max()) / scale:.3g})"
            print(f"  {n[:-4]:<32} err {err:.3g}  first row over {first} of {x.shape[0]}{noise}")
            shown += 1
            if shown >= a.show:
                break
    if shown == 0:
        print("  every traced tensor within the threshold")


if __name__ == "__main__":
    main()
