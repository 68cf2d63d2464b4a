#!/usr/bin/env bash
# Runs every device test on a machine with an NVIDIA GPU and prints pass/fail counts:
# each CUDA kernel against its CPU reference over ragged shapes (CudaOps, CudaMatmul, ...),
# the families on CUDA against the transformers goldens (CudaGolden, ...), and the CLI on
# --device cuda. One command from a fresh device machine:
#
#   tests/device/run.sh [BUILD_DIR]        # default: build-cuda
#
# BUILD_DIR holds turbospark and turbospark_device_tests built with -DTURBOSPARK_CUDA=ON
# (`scripts/setup.sh --cuda` builds them into build-cuda on any machine with nvcc, GPU or
# not) plus, in BUILD_DIR/lib, the few shared libraries of ours the GPU machine's image
# lacks (setup.sh --cuda copies libfmt there). When BUILD_DIR has no binaries the script
# builds them here, from the Debian packages tests/device/fetch_deps.sh downloaded into
# .devdeps/ (the device image has CMake and nvcc but none of our libraries and no network).
# Results and logs go to $OUT when it is set (the device tool's output folder), else to
# BUILD_DIR/device-results.
set -uo pipefail
cd "$(dirname "$0")/../.."
# Every family runs on CUDA without the unverified-kernels override (CudaRefusals checks that).
unset TURBOSPARK_CUDA_UNVERIFIED
build=${1:-build-cuda}
out=${OUT:-$build/device-results}
mkdir -p "$out"

if [ ! -x "$build/turbospark_device_tests" ] || [ ! -x "$build/turbospark" ]; then
  echo "run.sh: no binaries in $build: building from .devdeps" >&2
  [ -d .devdeps ] || { echo "run.sh: .devdeps missing: run tests/device/fetch_deps.sh on a machine with apt first" >&2; exit 2; }
  prefix=/tmp/turbospark-deps
  mkdir -p "$prefix"
  for deb in .devdeps/*.deb; do dpkg -x "$deb" "$prefix"; done
  cmake -S . -B "$build" -DTURBOSPARK_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DTURBOSPARK_NATIVE=OFF \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_FIND_ROOT_PATH="$prefix" >"$out/cmake.log" 2>&1 ||
    { tail -20 "$out/cmake.log"; exit 1; }
  cmake --build "$build" -j"$(nproc)" --target turbospark turbospark_device_tests >"$out/build.log" 2>&1 ||
    { grep -E "error" "$out/build.log" | head -30; exit 1; }
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
export LD_LIBRARY_PATH="$PWD/$build/lib:${LD_LIBRARY_PATH:-}"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

pass=0
fail=0
# gtest: one line per binary run; the summary lines give the counts.
run_gtest() {
  local name=$1
  shift
  "$@" --gtest_color=no >"$out/$name.log" 2>&1
  local rc=$?
  local p f
  p=$(grep -E '^\[  PASSED  \] [0-9]+ test' "$out/$name.log" | grep -oE '[0-9]+' | head -1)
  f=$(grep -E '^\[  FAILED  \] [0-9]+ test' "$out/$name.log" | grep -oE '[0-9]+' | head -1)
  p=${p:-0}
  f=${f:-0}
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "$name: exited $rc" >&2; tail -20 "$out/$name.log" >&2; fi
  grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$name.log" | sort -u >&2
  echo "$name: $p passed, $f failed"
  pass=$((pass + p))
  fail=$((fail + f))
}

run_gtest device_tests "$build/turbospark_device_tests"

# The CLI on the GPU: refusals by name, and a fixture answering the same on both devices.
cli_check() {
  local what=$1 want=$2
  shift 2
  local got
  got=$("$@" 2>&1)
  if grep -q -- "$want" <<<"$got"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "cli: $what: wanted '$want', got: $got" >&2
  fi
}
fx=tests/data/fixtures
cli_check "unknown device refused" "unknown device" "$build/turbospark" logits --model $fx/qwen3_tiny --tokens 1,2 --device tpu --out /tmp/x.npy
# The trained fixtures of the hybrid families (verified on CUDA 2026-12-05: Qwen4-Exp, then
# gpt-oss and Gemma 4) answer with the same greedy ids on both devices from the command line.
for f in qwen4_exp_trained_tiny gpt_oss_trained_tiny gemma4_trained_tiny; do
  ids=$("$build/turbospark" generate --model $fx/$f --tokens 3,1,4,1,5,9,2,6 --max-tokens 16 --temperature 0 --format ids --device cpu 2>/dev/null)
  cli_check "$f generate ids equal on cpu and cuda ($ids)" "^${ids:-none}\$" "$build/turbospark" generate --model $fx/$f \
    --tokens 3,1,4,1,5,9,2,6 --max-tokens 16 --temperature 0 --format ids --device cuda
done
cpu_ids=$("$build/turbospark" generate --model $fx/llama_tiny --tokens 3,1,4,1,5,9,2,6 --max-tokens 12 --temperature 0 --format ids --device cpu 2>/dev/null)
cli_check "generate ids equal on cpu and cuda ($cpu_ids)" "^${cpu_ids:-none}\$" "$build/turbospark" generate --model $fx/llama_tiny --tokens 3,1,4,1,5,9,2,6 --max-tokens 12 --temperature 0 --format ids --device cuda
# Programmatic dependent launch (kernels scheduled while the previous one drains) must not
# change a bit: greedy ids of a MoE fixture over 40 graph-replayed decode steps, with and
# without it.
moe_args="generate --model $fx/qwen3_moe_tiny --tokens 3,1,4,1,5,9,2,6 --max-tokens 40 --temperature 0 --format ids --device cuda"
nopdl_ids=$(TURBOSPARK_CUDA_PDL=0 "$build/turbospark" $moe_args 2>/dev/null)
cli_check "generate ids equal with and without PDL ($nopdl_ids)" "^${nopdl_ids:-none}\$" "$build/turbospark" $moe_args
# The fused short-span decode attention (attention_decode_fused.cu, opt-in) against the separate
# kernels: the same greedy ids over 40 graph-replayed steps with it turned on.
nofused_ids=$("$build/turbospark" $moe_args 2>/dev/null)
cli_check "generate ids equal with and without the fused decode attention ($nofused_ids)" "^${nofused_ids:-none}\$" \
  env TURBOSPARK_CUDA_DECODE_FUSED_MAX_SPAN=1024 "$build/turbospark" $moe_args
# Expert streaming's device tier: routed experts in host memory through 2 device slots (every
# layer evicts) answer with the resident run's greedy ids, and the run reports its cache.
stream_out=$("$build/turbospark" $moe_args --expert-cache-slots 2 2>&1)
stream_ids=$(grep -E '^[0-9]+(,[0-9]+)*$' <<<"$stream_out" | head -1)
cli_check "streamed experts give the resident ids ($nofused_ids)" "^${nofused_ids:-none}\$" echo "$stream_ids"
cli_check "streamed experts report the device cache" "expert streaming: 2 device slots" echo "$stream_out"
# --gpu-memory-gb: under a 1 GiB cap the MoE fixture no longer fits beside the 1 GiB kept for
# activations, so its experts stream on their own, with the same ids.
capped_out=$("$build/turbospark" $moe_args --gpu-memory-gb 1 2>&1)
capped_ids=$(grep -E '^[0-9]+(,[0-9]+)*$' <<<"$capped_out" | head -1)
cli_check "a capped GPU streams experts by itself ($nofused_ids)" "^${nofused_ids:-none}\$" echo "$capped_ids"
cli_check "the capped run says why it streams" "exceed the device memory" echo "$capped_out"
# `serve` on the GPU: one completion from the Q4_0 fixture GGUF over HTTP, then SIGTERM exits 0.
serve_check() {
  local log=$out/serve.log port="" i
  "$build/turbospark" serve --device cuda --model $fx/qwen3_moe_gguf_tiny/qwen3_moe_gguf_tiny-q4_0.gguf --port 0 \
    --parallel 2 --ctx 256 2>"$log" &
  local pid=$!
  for i in $(seq 100); do
    port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f3)
    [ -n "$port" ] && break
    sleep 0.2
  done
  local answer
  answer=$(python3 - "$port" 2>&1 <<'PY'
import json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", method="POST",
                             data=json.dumps({"prompt": "hello world", "max_tokens": 8, "temperature": 0}).encode(),
                             headers={"Content-Type": "application/json"})
r = json.loads(urllib.request.urlopen(req, timeout=60).read())
print(r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"])
PY
)
  kill -TERM "$pid"
  wait "$pid"
  echo "$answer exit $?"
}
cli_check "serve answers a completion on cuda and exits 0 on SIGTERM" "^length 8 exit 0$" serve_check
if [ -n "${TS_DEFAULT_GGUF:-}" ] && [ -f "${TS_DEFAULT_GGUF}" ]; then
  cli_check "default model answers Paris on cuda" "Paris" "$build/turbospark" run --model "$TS_DEFAULT_GGUF" --device cuda --temperature 0 --max-tokens 24 "What is the capital of France?"
else
  echo "cli: TS_DEFAULT_GGUF not set: the Paris check did not run" >&2
fi

echo "device: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
