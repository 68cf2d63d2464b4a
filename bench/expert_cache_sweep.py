#!/usr/bin/env python3
"""Decode speed and expert-cache hit rate against the cache budget (expert streaming).

Runs `turbospark bench` on one MoE model with the routed experts resident (no streaming) and
then streamed through caches of several budgets, given as fractions of the routed experts'
bytes, and writes a CSV and a PNG plot (matplotlib) of decode tok/s and hit rate per budget.

    python3 bench/expert_cache_sweep.py --model M.gguf --out /tmp/sweep \
        [--budgets 0.1,0.25,0.5,1.0] [--prompt 16] [--decode 32] [--device cpu] [--ts build/turbospark]

Needs matplotlib (PyPI: pip install matplotlib). On --device cuda the streamed runs use the
device tier (slots in GPU memory fed from host memory); its hit rate is over the whole bench
(prompt and decode), the CPU tier's over the decode steps. Decode feeds random tokens (`bench
--random-decode`, as llama-bench's tg does): a random-weight model's greedy output repeats one
token, which would make every routing a repeat. tools/make_random_gguf.py's files route near
uniformly (a cache's worst case) unless written with --router-skew S: say which beside the numbers,
with the `--router-stats` summary.
"""
import argparse
import csv
import os
import re
import subprocess
import sys


def run_bench(ts, model, device, prompt, decode, extra):
    cmd = [ts, "bench", "-m", model, "--device", device, "--prompt", str(prompt), "--decode", str(decode),
           "--repeat", "1", "--no-membw", "--random-decode"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"expert_cache_sweep: {' '.join(cmd)} failed:\n{p.stderr.strip().splitlines()[-1:]}")
    out, err = p.stdout, p.stderr
    row = {"command": " ".join(cmd)}
    m = re.search(r"^prefill\s+([\d.]+) tok/s", out, re.M)
    row["prefill_tok_s"] = float(m.group(1)) if m else float("nan")
    m = re.search(r"^decode\s+([\d.]+) tok/s", out, re.M)
    row["decode_tok_s"] = float(m.group(1)) if m else float("nan")
    m = re.search(r"^experts\s+([\d.]+) MiB read from disk per decode token, ([\d.]+)% cache hits", out, re.M)
    row["mib_per_token"] = float(m.group(1)) if m else 0.0
    row["hit_pct"] = float(m.group(2)) if m else 100.0
    # The device tier (--device cuda) reports over the whole bench: its hit rate stands in.
    m = re.search(r"^expert cache \(device\): .* hits ([\d.]+)% \((\d+) of (\d+)\), ([\d.]+) GiB loaded", out, re.M)
    if m:
        row["hit_pct"] = float(m.group(1))
        row["device_gib_loaded"] = float(m.group(4))
    m = re.search(r"expert streaming: (\d+) (?:device )?slots x ([\d.]+) MiB = [\d.]+ GiB for (\d+) routed experts "
                  r"\(([\d.]+) GiB\)", err)
    if m:
        row["slots"], row["expert_mib"], row["routed"], row["routed_gib"] = (int(m.group(1)), float(m.group(2)),
                                                                             int(m.group(3)), float(m.group(4)))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="folder for sweep.csv and sweep.png")
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0", help="fractions of the routed experts' bytes")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ts", default="build/turbospark")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # How many routed experts there are: a cache of "all of them" reports it.
    probe = run_bench(args.ts, args.model, args.device, 1, 1, ["--expert-cache-slots", "100000000"])
    if "routed" not in probe:
        sys.exit("expert_cache_sweep: the model reported no routed experts (a dense model?)")
    routed = probe["routed"]
    rows = []
    base = run_bench(args.ts, args.model, args.device, args.prompt, args.decode, ["--expert-cache-slots", "0"])
    base.update(budget="resident", fraction=None, slots=routed)
    rows.append(base)
    for f in [float(x) for x in args.budgets.split(",")]:
        slots = max(1, int(round(f * routed)))
        r = run_bench(args.ts, args.model, args.device, args.prompt, args.decode, ["--expert-cache-slots", str(slots)])
        r.update(budget=f"{100 * f:g}%", fraction=f, slots=slots)
        rows.append(r)
        print(f"budget {r['budget']:>8} ({slots} slots): decode {r['decode_tok_s']:.2f} tok/s, "
              f"{r['hit_pct']:.1f}% hits, {r['mib_per_token']:.1f} MiB/token", flush=True)
    print(f"resident: decode {base['decode_tok_s']:.2f} tok/s", flush=True)

    keys = ["budget", "fraction", "slots", "decode_tok_s", "prefill_tok_s", "hit_pct", "mib_per_token", "command"]
    with open(os.path.join(args.out, "sweep.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    streamed = [r for r in rows if r["fraction"] is not None]
    x = [100 * r["fraction"] for r in streamed]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["decode_tok_s"] for r in streamed], "o-", color="tab:blue", label="decode tok/s (streamed)")
    ax.axhline(base["decode_tok_s"], color="tab:blue", ls="--", lw=1, label="decode tok/s (resident)")
    ax.set_xlabel("expert cache budget (% of routed expert bytes)")
    ax.set_ylabel("decode tok/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, [r["hit_pct"] for r in streamed], "s-", color="tab:orange", label="cache hit rate")
    ax2.set_ylabel("hit rate while decoding (%)", color="tab:orange")
    ax2.set_ylim(0, 100)
    ax.set_title(os.path.basename(args.model) + f" ({args.device})", fontsize=9)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "sweep.png"), dpi=120)
    print(f"wrote {args.out}/sweep.csv and {args.out}/sweep.png")


if __name__ == "__main__":
    main()
