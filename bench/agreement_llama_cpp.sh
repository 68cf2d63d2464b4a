#!/usr/bin/env bash
# Teacher-forced agreement between turbospark and llama.cpp on one GGUF and one text.
#
#   bench/agreement_llama_cpp.sh [GGUF] [TEXT] [CTX] [CHUNKS]
#
#   GGUF    model file (default: the installed default model)
#   TEXT    a UTF-8 text (default: /usr/share/games/fortunes/fortunes from the Debian
#           package fortunes-min: `apt-get install fortunes-min`)
#   CTX     tokens per chunk (default 512); the second half of each chunk is scored
#   CHUNKS  chunks to use (default 4: 4 x 255 = 1020 scored tokens)
#
# 1. `turbospark perplexity` tokenizes TEXT, runs each chunk and writes the scored
#    log-probabilities in llama-perplexity's --kl-divergence-base format.
# 2. `llama-perplexity` computes its own perplexity on the same text (its own tokenizer).
# 3. `llama-perplexity --kl-divergence` re-reads turbospark's tokens and log-probs, runs
#    llama.cpp on exactly those tokens and prints both perplexities, their ratio, the KL
#    divergence and "Same top p" (how often both engines' top-1 tokens agree).
# 4. With FLOOR=1, llama.cpp against itself: its default run (flash attention, f16 KV cache;
#    with flash attention llama.cpp casts an f32 cache to f16, so -ctk/-ctv f32 alone change
#    nothing) as the base, re-run with -fa off -ctk f32 -ctv f32. This is the noise floor:
#    Qwen2.5's massive activations (one channel ~3800 on the first token) make the 8-bit
#    activation quantization of both engines (Q8_K, one scale per 256 values) flip roundings
#    on ulp-level differences, so any two correct implementations land about this far apart.
# Threads: THREADS (default nproc) for both engines. LLAMA_BIN: dir with llama-perplexity
# (default: built/reused by bench/build_llama_cpp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf="${1:-$HOME/.local/share/turbospark/default-model.gguf}"
text="${2:-/usr/share/games/fortunes/fortunes}"
ctx="${3:-512}"
chunks="${4:-4}"
threads="${THREADS:-$(nproc)}"
turbospark="${TURBOSPARK:-build/turbospark}"
[[ -f "$gguf" ]] || { echo "agreement_llama_cpp: no such file $gguf" >&2; exit 2; }
[[ -f "$text" ]] || { echo "agreement_llama_cpp: no such file $text (apt-get install fortunes-min)" >&2; exit 2; }
bin="${LLAMA_BIN:-$(bench/build_llama_cpp.sh)}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== turbospark perplexity ($gguf, ctx $ctx, $chunks chunks, $threads threads)"
"$turbospark" perplexity -m "$gguf" -f "$text" -c "$ctx" --chunks "$chunks" -t "$threads" \
  --kl-divergence-base "$work/ts.kld" | tee "$work/ts.txt"

echo "== llama.cpp perplexity on the same text (its own tokenization)"
"$bin/llama-perplexity" -m "$gguf" -f "$text" -c "$ctx" --chunks "$chunks" -t "$threads" -b "$ctx" \
  >"$work/llama.txt" 2>&1 || { tail -n 20 "$work/llama.txt" >&2; exit 1; }
grep -E "tokenizing|Final estimate" "$work/llama.txt" || true

echo "== llama.cpp on turbospark's tokens: KL divergence and top-1 agreement (base = turbospark)"
"$bin/llama-perplexity" -m "$gguf" -c "$ctx" -t "$threads" -b "$ctx" \
  --kl-divergence-base "$work/ts.kld" --kl-divergence >"$work/kld.txt" 2>&1 ||
  { tail -n 20 "$work/kld.txt" >&2; exit 1; }
sed -n '/====== Perplexity statistics/,$p' "$work/kld.txt" | grep -E "PPL|KLD|Same top|Mean|=====" | head -20

if [[ "${FLOOR:-0}" == 1 ]]; then
  echo "== noise floor: llama.cpp default (base) vs llama.cpp -fa off -ctk f32 -ctv f32, same tokens"
  "$bin/llama-perplexity" -m "$gguf" -f "$text" -c "$ctx" --chunks "$chunks" -t "$threads" -b "$ctx" \
    --kl-divergence-base "$work/llama.kld" >"$work/floor_base.txt" 2>&1 ||
    { tail -n 20 "$work/floor_base.txt" >&2; exit 1; }
  "$bin/llama-perplexity" -m "$gguf" -c "$ctx" -t "$threads" -b "$ctx" -fa off -ctk f32 -ctv f32 \
    --kl-divergence-base "$work/llama.kld" --kl-divergence >"$work/floor.txt" 2>&1 ||
    { tail -n 20 "$work/floor.txt" >&2; exit 1; }
  sed -n '/====== Perplexity statistics/,$p' "$work/floor.txt" | grep -E "Mean    KLD|RMS Δp|Same top" || true
fi

python3 - "$work/ts.txt" "$work/llama.txt" "$work/kld.txt" <<'EOF'
import re, sys
ts = float(re.search(r"PPL = ([0-9.]+)", open(sys.argv[1]).read()).group(1))
m = re.search(r"Final estimate: PPL = ([0-9.]+)", open(sys.argv[2], errors="replace").read())
kld = open(sys.argv[3], errors="replace").read()
top = re.search(r"Same top p\s*:\s*([0-9.]+)", kld)
q = re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", kld)
print("== summary")
print(f"turbospark PPL          {ts:.4f}")
if m:
    ll = float(m.group(1))
    print(f"llama.cpp PPL           {ll:.4f}  (own tokenization; turbospark/llama.cpp = {ts / ll:.4f}, diff {100 * (ts / ll - 1):+.2f}%)")
if q:
    lq = float(q.group(1))
    print(f"llama.cpp PPL, same ids {lq:.4f}  (turbospark/llama.cpp = {ts / lq:.4f}, diff {100 * (ts / lq - 1):+.2f}%)")
if top:
    print(f"top-1 agreement         {top.group(1)}%")
EOF
