#!/usr/bin/env python3
"""Where two runs of one MoE model route differently: runs `turbospark logits --router-out` on the
CPU (optionally at CUDA's precision) and on CUDA with the same tokens and chunk, then prints, per
MoE layer, the rows whose top-k expert sets differ and the CPU's margin there (the k-th largest
probability minus the (k+1)-th, over the largest). A tiny margin is a near tie that summation order
alone may flip; a large one is a kernel error.

    python3 tools/router_flips.py --ts build-cuda/turbospark --model tests/data/fixtures/gpt_oss_mxfp4_tiny \
        [--long] [--chunk 0] [--k 4] [--precision cuda]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diff_trace  # noqa: E402  (its `logits` runner)


def route(ts, model, device, tokens, chunk, out_dir, precision):
    out = os.path.join(out_dir, "router.npy")
    diff_trace.run(ts, model, device, tokens, chunk, out_dir, precision, extra=["--router-out", out])
    return np.load(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ts", default="build-cuda/turbospark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--long", action="store_true", help="the fixture's long_golden.json tokens")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--k", type=int, required=True, help="experts per token")
    ap.add_argument("--precision", default="cuda")
    ap.add_argument("--work", default="/tmp/router_flips")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    g = json.load(open(os.path.join(args.model, "long_golden.json" if args.long else "golden.json")))
    tokens = ",".join(map(str, g["tokens"]))
    cpu = route(args.ts, args.model, "cpu", tokens, args.chunk, os.path.join(args.work, "cpu"), args.precision)
    gpu = route(args.ts, args.model, "cuda", tokens, args.chunk, os.path.join(args.work, "cuda"), args.precision)
    k = args.k
    print(f"{os.path.basename(args.model)} tokens {cpu.shape[1]} chunk {args.chunk} cpu precision {args.precision}")
    for layer in range(cpu.shape[0]):
        a, b = cpu[layer], gpu[layer]
        if not np.any(a):
            continue  # a dense layer
        sa = np.argsort(-a, axis=1, kind="stable")[:, :k]
        sb = np.argsort(-b, axis=1, kind="stable")[:, :k]
        flips = [t for t in range(a.shape[0]) if set(sa[t]) != set(sb[t])]
        srt = -np.sort(-a, axis=1)
        for t in flips:
            margin = (srt[t, k - 1] - srt[t, k]) / max(srt[t, 0], 1e-30)
            print(f"  layer {layer} row {t}: cpu {sorted(sa[t].tolist())} cuda {sorted(sb[t].tolist())} "
                  f"cpu margin {margin:.3g}")
        if not flips:
            print(f"  layer {layer}: same experts on every row")


if __name__ == "__main__":
    main()
