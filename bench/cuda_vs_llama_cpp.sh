#!/usr/bin/env bash
# turbospark vs llama.cpp on CUDA, same GGUF file, same run (run on the device machine).
#
# Writes a random-weight GGUF with tools/make_random_gguf.py (llama.cpp's gguf-py writes it):
# Qwen3-30B-A3B's shape by default, gpt-oss-20b's with PRESET=gpt-oss-20b (MXFP4 experts), or
# Qwen4-Exp's at Flash-Next widths with PRESET=qwen4exp-flash-next (8 layers, Q8_0), then
# benchmarks it with llama.cpp's `llama-bench -ngl 99 -fa 1` and with `turbospark bench --device
# cuda --random-decode` (random decode tokens, as llama-bench's tg feeds) at each prompt length.
# Random routing spreads over the experts (codes symmetric about zero).
#
#   LLAMA_BENCH=/tmp/llama-bench GGUF_PY=.peer/gguf-py TS=build-cuda/turbospark \
#     bench/cuda_vs_llama_cpp.sh OUTDIR
#   LLAMA_SRC_TAR=llama_trim.tar.xz GGUF_PY=... bench/cuda_vs_llama_cpp.sh OUTDIR   # builds it first
#
# Environment:
#   LLAMA_BENCH  llama.cpp's llama-bench built with -DGGML_CUDA=ON, or
#   LLAMA_SRC_TAR  bench/trim_llama_cpp_cuda.sh's tarball: built here first (all cores, ~4 min)
#   GGUF_PY      llama.cpp's gguf-py folder (required unless the GGUF already exists)
#   TS           turbospark binary (default build-cuda/turbospark)
#   PRESET       qwen3-30b-a3b (default), gpt-oss-20b or qwen4exp-flash-next
#   GGUF_TYPE    q4_0 (default; q8_0 for gpt-oss-20b, whose experts are MXFP4 whatever it says, and the
#                only type of qwen4exp-flash-next), q4_k or q8_0
#   LAYERS       depth (default: the preset's, the real model's)
#   PROMPTS      prompt lengths (default "512 2048 8192")
#   REPEAT       repetitions, medians reported (default 3)
#   PROFILE=1    also `turbospark bench --profile` at the first prompt length
set -euo pipefail

out="${1:?usage: cuda_vs_llama_cpp.sh OUTDIR}"
mkdir -p "$out"
ts="${TS:-build-cuda/turbospark}"
if [[ -z "${LLAMA_BENCH:-}" && -n "${LLAMA_SRC_TAR:-}" ]]; then
  lsrc="${TMPDIR:-/tmp}/llama-trim-src" lbuild="${TMPDIR:-/tmp}/llama-trim-build"
  mkdir -p "$lsrc" && tar xJf "$LLAMA_SRC_TAR" -C "$lsrc"
  echo "== building llama-bench (CUDA, sm_90) from $LLAMA_SRC_TAR" >&2
  cmake -S "$lsrc/llama.cpp" -B "$lbuild" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF >"$out/llama_cmake.log" 2>&1
  cmake --build "$lbuild" -j"$(nproc)" --target llama-bench >"$out/llama_build.log" 2>&1
  LLAMA_BENCH="$lbuild/bin/llama-bench"
fi
lb="${LLAMA_BENCH:?set LLAMA_BENCH to a CUDA llama-bench, or LLAMA_SRC_TAR to build one}"
preset="${PRESET:-qwen3-30b-a3b}"
case "$preset" in
  qwen3-30b-a3b) type="${GGUF_TYPE:-q4_0}" layers="${LAYERS:-48}" ;;
  gpt-oss-20b) type="${GGUF_TYPE:-q8_0}" layers="${LAYERS:-24}" ;;
  qwen4exp-flash-next) type="${GGUF_TYPE:-q8_0}" layers="${LAYERS:-8}" ;;
  *) echo "cuda_vs_llama_cpp.sh: PRESET must be qwen3-30b-a3b, gpt-oss-20b or qwen4exp-flash-next, got '$preset'" >&2; exit 2 ;;
esac
prompts="${PROMPTS:-512 2048 8192}"
repeat="${REPEAT:-3}"
gguf="${TMPDIR:-/tmp}/$preset-random-$type-${layers}L.gguf"

if [[ ! -f "$gguf" ]]; then
  PYTHONPATH="${GGUF_PY:?set GGUF_PY to llama.cpp\'s gguf-py}${PYTHONPATH:+:$PYTHONPATH}" \
    python3 tools/make_random_gguf.py --preset "$preset" --type "$type" --layers "$layers" --out "$gguf"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
csv=$(echo "$prompts" | tr ' ' ',')
echo "== llama.cpp: $lb -m $gguf -ngl 99 -fa 1 -p $csv -n 128 -r $repeat"
"$lb" -m "$gguf" -ngl 99 -fa 1 -p "$csv" -n 128 -r "$repeat" 2>"$out/llama_bench_$type.log" |
  tee "$out/llama_bench_$type.md"
for p in $prompts; do
  echo "== turbospark: $ts bench --device cuda -m $gguf --prompt $p --decode 128 --repeat $repeat --random-decode"
  "$ts" bench --device cuda -m "$gguf" --prompt "$p" --decode 128 --repeat "$repeat" --random-decode 2>>"$out/turbospark_$type.log" |
    tee -a "$out/turbospark_$type.txt"
done
if [[ "${PROFILE:-0}" == 1 ]]; then
  p="${prompts%% *}"
  echo "== turbospark profile: $ts bench --device cuda -m $gguf --prompt $p --decode 32 --repeat 1 --profile"
  "$ts" bench --device cuda -m "$gguf" --prompt "$p" --decode 32 --repeat 1 --profile --no-membw \
    2>>"$out/turbospark_$type.log" | tee -a "$out/turbospark_profile_$type.txt"
fi
