#!/usr/bin/env bash
# Prompt-processing (pp) and text-generation (tg) throughput of llama.cpp on a GGUF, in a
# compact table, next to `turbospark bench` on the same file, same threads and lengths
# (see the TURBOSPARK section below; n/a where turbospark cannot run the file).
#
#   bench/compare_llama_cpp.sh GGUF [PROMPT] [THREADS]
#
#   GGUF     model file (e.g. the path printed by scripts/install_gguf_default.sh)
#   PROMPT   prompt text, or @FILE; its token count (llama-tokenize) sets the pp length.
#            Default: a fixed English paragraph. PP=N overrides the length (e.g. PP=512).
#   THREADS  threads for both engines (default: nproc)
#
# Environment: TG (tokens generated, default 64), REPS (llama-bench -r, default 5),
#   ROUNDS (alternating llama.cpp / turbospark rounds, default 1; the table shows medians),
#   LLAMA_BIN (dir with llama-bench; default: built/reused by bench/build_llama_cpp.sh),
#   TURBOSPARK (turbospark binary, default build/turbospark),
#   OMP_WAIT_POLICY (default PASSIVE: llama.cpp is built with OpenMP, whose default
#   spin-waiting collapses when the 2 cores are shared with anything else, e.g. 0.6 vs
#   4.5 tok/s tg for a 1.5B Q4_K_M under a parallel build; set ACTIVE on an idle machine).
#
# Rows:  pp<N>       prefill of N prompt tokens from an empty context
#        tg<T>       T tokens decoded from an empty context (llama-bench's classic tg)
#        tg<T>@d<N>  T tokens decoded after an N-token prompt (what `turbospark bench` times)
set -euo pipefail
cd "$(dirname "$0")/.."

gguf="${1:?usage: bench/compare_llama_cpp.sh GGUF [PROMPT] [THREADS]}"
prompt="${2:-The history of the city of Paris spans more than two thousand years. It began as a small settlement of the Parisii tribe on an island in the Seine, grew into the Roman town of Lutetia, and later became the capital of the Frankish kings. Explain in detail how the city changed during the Middle Ages and why.}"
threads="${3:-$(nproc)}"
tg="${TG:-64}"
reps="${REPS:-5}"
rounds="${ROUNDS:-1}"
turbospark="${TURBOSPARK:-build/turbospark}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
[[ -f "$gguf" ]] || { echo "compare_llama_cpp: no such file $gguf" >&2; exit 2; }

bin="${LLAMA_BIN:-$(bench/build_llama_cpp.sh)}"
[[ "$prompt" == @* ]] && prompt="$(cat "${prompt#@}")"

# pp length = the prompt's token count under the model's own tokenizer (BOS included).
if [[ -n "${PP:-}" ]]; then
  pp="$PP"
else
  pp=$("$bin/llama-tokenize" -m "$gguf" -p "$prompt" --ids --log-disable 2>/dev/null |
       tail -n 1 | tr -cd ',' | wc -c)
  pp=$((pp + 1))
fi

load_start="$(cut -d' ' -f1-3 /proc/loadavg)"
results="$(mktemp)"
trap 'rm -f "$results" "$results.err"' EXIT

# Appends "engine<TAB>test<TAB>tok/s" lines to $results.
run_llama_cpp() {
  local json
  for args in "-p $pp -n $tg" "-p 0 -n $tg -d $pp"; do
    # shellcheck disable=SC2086
    if ! json=$("$bin/llama-bench" -m "$gguf" -t "$threads" -r "$reps" $args -o json 2>"$results.err"); then
      echo "compare_llama_cpp: llama-bench $args failed:" >&2
      tail -n 5 "$results.err" >&2
      exit 1
    fi
    python3 -c '
import json, sys
for r in json.loads(sys.stdin.read()):
    p, g, d = r["n_prompt"], r["n_gen"], r.get("n_depth", 0)
    name = f"pp{p}" if p else f"tg{g}"
    if d: name += f"@d{d}"
    ts = r["avg_ts"]
    print(f"llama.cpp\t{name}\t{ts:.2f}")
' <<<"$json" >>"$results"
  done
}

# ---------------------------------------------------------------------------------------
# TURBOSPARK: `turbospark bench --model GGUF`, for the GGUF families turbospark reads (a
# file it cannot run yet is reported and skipped, leaving n/a in the table). It runs in the
# same rounds as llama.cpp (alternating, so drift in machine load or clocks hits both
# engines alike) with the same thread count, prompt length and decode length. Its prompt
# is random token ids of the same length; llama-bench also times synthetic tokens.
# `turbospark bench` prints
#   prefill      X tok/s  (N tokens, median of R)
#   decode       Y tok/s  (T tokens after the prompt, median of R)
# which map to the rows pp<N> and tg<T>@d<N>.
# ---------------------------------------------------------------------------------------
run_turbospark() {
  local out
  if [[ ! -x "$turbospark" ]]; then
    echo "compare_llama_cpp: $turbospark not built; skipping turbospark" >&2
    return 0
  fi
  if ! out=$("$turbospark" bench --model "$gguf" --prompt "$pp" --decode "$tg" \
               --threads "$threads" --repeat "$reps" --no-membw 2>&1); then
    echo "compare_llama_cpp: turbospark bench cannot run this GGUF yet: $(tail -n 1 <<<"$out")" >&2
    return 0
  fi
  awk -v pp="$pp" -v tg="$tg" '
    $1 == "prefill" && $3 == "tok/s" { printf "turbospark\tpp%s\t%s\n", pp, $2 }
    $1 == "decode"  && $3 == "tok/s" { printf "turbospark\ttg%s@d%s\t%s\n", tg, pp, $2 }' <<<"$out" >>"$results"
}

for ((r = 1; r <= rounds; r++)); do
  run_llama_cpp
  run_turbospark
done

# Table: one row per test, one column per engine (median over rounds: on a shared machine
# one disturbed round should not move the result), plus the ratio and every round's value.
echo "model: $gguf"
echo "threads: $threads  prompt tokens: $pp  generated: $tg  llama-bench -r $reps  rounds: $rounds  OMP_WAIT_POLICY=$OMP_WAIT_POLICY"
echo "load average before: $load_start  after: $(cut -d' ' -f1-3 /proc/loadavg)  (2 cores: above ~2 the numbers are not an idle machine's)"
python3 - "$results" <<'EOF'
import collections, statistics, sys
vals = collections.defaultdict(list)
tests = []
for line in open(sys.argv[1]):
    eng, test, tps = line.rstrip("\n").split("\t")
    vals[(eng, test)].append(float(tps))
    if test not in tests:
        tests.append(test)
def cell(eng, test):
    v = vals.get((eng, test))
    return statistics.median(v) if v else None
def rounds(eng, test):
    return " ".join(f"{x:.1f}" for x in vals.get((eng, test), [])) or "-"
print(f"{'test':<14}{'llama.cpp t/s':>15}{'turbospark t/s':>16}{'ts/llama':>10}   rounds (llama.cpp | turbospark)")
for t in tests:
    a, b = cell("llama.cpp", t), cell("turbospark", t)
    fa = f"{a:.2f}" if a is not None else "-"
    fb = f"{b:.2f}" if b is not None else "n/a"
    ratio = f"{b / a:.2f}x" if a and b else "-"
    print(f"{t:<14}{fa:>15}{fb:>16}{ratio:>10}   {rounds('llama.cpp', t)} | {rounds('turbospark', t)}")
EOF
