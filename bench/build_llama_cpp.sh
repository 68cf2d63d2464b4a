#!/usr/bin/env bash
# Builds a llama.cpp peer (CPU only) for benchmarks and numerical comparisons.
#
# llama.cpp itself cannot be fetched here (only PyPI and Debian are reachable), but the
# llama-cpp-python sdist on PyPI vendors a full llama.cpp tree under vendor/llama.cpp.
# This script pip-downloads that sdist (pinned), unpacks it OUTSIDE the repo and builds the
# command-line tools with cmake. Nothing from llama.cpp is ever copied into the repo.
#
#   bench/build_llama_cpp.sh            # builds (or reuses) and prints the bin dir on stdout
#   LLAMA_BIN=$(bench/build_llama_cpp.sh)
#
# Environment:
#   LLAMA_CPP_PY_VERSION  llama-cpp-python sdist version (default 0.3.36 -> llama.cpp 0c1e57098)
#   TURBOSPARK_LLAMA_DIR  where to unpack and build
#                         (default ${XDG_CACHE_HOME:-~/.cache}/turbospark/llama.cpp-<version>)
#   JOBS                  parallel build jobs (default: nproc)
#   LLAMA_WITH_CLI=1      also build llama-cli (needs the server library: much longer build)
#   LLAMA_WITH_SERVER=1   also build llama-server (the serving peer of bench/serve_bench.py)
#   FORCE=1               rebuild even if the binaries exist
#
# Binaries built (in the printed bin dir):
#   llama-completion   classic generator (old llama-cli): -p, -cnv / -no-cnv, --jinja, greedy
#                      with --temp 0 (or --top-k 1), -n N; single-turn chat: -cnv -st
#   llama-simple, llama-simple-chat   minimal generation / chat loops
#   llama-bench        pp/tg throughput (-p N -n N -r 5 -t T)
#   llama-perplexity   teacher-forced evaluation. `llama-perplexity -m M -f TEXT -c CTX
#                      [--chunks K] --kl-divergence-base OUT.kld` SAVES the log-probs of every
#                      scored position to OUT.kld; `llama-perplexity -m OTHER
#                      --kl-divergence-base OUT.kld --kl-divergence` re-reads the tokens from
#                      it and prints KLD, top-1 agreement ("Same top p") and the PPL ratio.
#                      OUT.kld layout (little endian): "_logits_", int32 n_ctx, int32 n_vocab,
#                      int32 n_chunk, int32 tokens[n_chunk*n_ctx] (BOS replaces token 0 of
#                      each chunk when the model adds BOS), then per chunk, for positions
#                      n_ctx/2 .. n_ctx-2 (each predicting the next token), a record of
#                      nv = 2*((n_vocab+1)/2)+4 uint16: float32 scale, float32 min_logprob,
#                      then q[n_vocab] with logprob[i] = min_logprob + scale*q[i] (q = 0
#                      means <= max-16); top-1 = argmax q.
#   llama-debug        -p PROMPT --save-logits [--logits-output-dir DIR]: float32 logits of
#                      the LAST prompt position (.bin, and .txt), the prompt and its int32
#                      token ids (-tokens.bin), for direct comparison
#   llama-eval-callback  prints every ggml op's tensor (per-layer activation diffing)
#   llama-tokenize     tokenizer reference (--ids, --no-bos, --stdin, -f FILE)
#   llama-gguf         dump GGUF metadata / tensors
set -euo pipefail

version="${LLAMA_CPP_PY_VERSION:-0.3.36}"
root="${TURBOSPARK_LLAMA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turbospark/llama.cpp-$version}"
jobs="${JOBS:-$(nproc)}"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
build="$root/build"
bin="$build/bin"

targets=(llama-completion llama-simple llama-simple-chat llama-bench llama-perplexity
         llama-debug llama-eval-callback llama-tokenize llama-gguf)
if [[ "${LLAMA_WITH_CLI:-0}" == 1 ]]; then targets+=(llama-cli); fi
if [[ "${LLAMA_WITH_SERVER:-0}" == 1 ]]; then targets+=(llama-server); fi

log() { echo "build_llama_cpp: $*" >&2; }

have_all() {
  local t
  for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
}

if [[ "${FORCE:-0}" != 1 ]] && have_all; then
  log "already built ($version) in $bin"
  echo "$bin"
  exit 0
fi

mkdir -p "$root"

# 1. sdist (pinned), from PyPI only.
sdist="$root/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
  log "downloading llama-cpp-python==$version sdist"
  tmp="$root/dl.$$"
  mkdir -p "$tmp"
  python3 -m pip download --quiet --no-binary :all: --no-deps -d "$tmp" \
      "llama-cpp-python==$version" >&2
  mv "$tmp"/llama_cpp_python-"$version".tar.gz "$sdist"
  rm -rf "$tmp"
fi

# 2. unpack (outside the repo).
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  log "unpacking $sdist"
  tar -xzf "$sdist" -C "$root"
fi
[[ -f "$src/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in the sdist"; exit 1; }

# 3. configure + build (CPU only, no network features). The ISA is the building machine's
# (-march=native) WITHOUT AMX: these Xeon VMs report AMX in cpuinfo, but the guest may not
# use the tile state, and ggml's AMX matmul then dies with SIGILL. Turning the AMX flags off
# in the compiler also compiles ggml's AMX kernels out (they are guarded by __AMX_INT8__).
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
isa=$(gcc -march=native -Q --help=target 2>/dev/null \
        | awk '$2 == "[enabled]" && $1 ~ /^-m(avx|fma|f16c|amx)/ {sub(/^-m/, "", $1); printf "%s ", $1}')
log "ISA: -march=native ($isa) with AMX turned off: $no_amx"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
server=OFF
[[ "${LLAMA_WITH_CLI:-0}" == 1 || "${LLAMA_WITH_SERVER:-0}" == 1 ]] && server=ON
# An earlier configure without the server library: configure again with it.
if [[ -f "$build/CMakeCache.txt" && "$server" == ON ]] && ! grep -q "^LLAMA_BUILD_SERVER:BOOL=ON" "$build/CMakeCache.txt"; then
  rm -f "$build/CMakeCache.txt"
fi
# A build configured before AMX was turned off: configure again.
if [[ -f "$build/CMakeCache.txt" ]] && ! grep -q -- "-mno-amx-int8" "$build/CMakeCache.txt"; then
  rm -f "$build/CMakeCache.txt"
fi
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  log "configuring in $build"
  cmake -S "$src" -B "$build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER="$server" -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-python-$version" \
    >&2
fi

start=$(date +%s)
log "building ${targets[*]} with $jobs jobs (10-20 min on 2 cores the first time)"
cmake --build "$build" --config Release -j "$jobs" --target "${targets[@]}" >&2
log "built in $(( $(date +%s) - start ))s"

have_all || { log "some binaries are missing in $bin"; exit 1; }
echo "$bin"
