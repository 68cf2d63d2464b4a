#!/usr/bin/env bash
# The sanitizer stage of the tests (issue 14), run by scripts/test.sh after the main suite:
# a clang build in build-san with AddressSanitizer + UndefinedBehaviorSanitizer (every
# report fatal) and libFuzzer, then
#   1. the unit tier and the golden tier but its `slow` tests under ASan + UBSan (FuzzReplay.*
#      replays every fuzz corpus and committed crash in this build too);
#   2. every fuzz harness for a short smoke over its seed corpus (FUZZ_SECONDS each, 30 by
#      default), new inputs kept in build-san/fuzz-corpus, crashes in build-san/fuzz-crashes.
# The cli tier (it runs the binary over whole conversations and the server) stays in the main
# suite: under ASan it would take most of CI's half hour on two cores.
#
#   scripts/sanitize.sh              # build, suite, smoke
#   FUZZ_SECONDS=0 scripts/sanitize.sh   # build and suite only
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FUZZ_SECONDS:-30}"
jobs="$(nproc)"
if ! command -v clang++ >/dev/null; then
  echo "sanitize: clang++ not found (scripts/setup.sh installs clang and libclang-rt-14-dev)" >&2
  exit 1
fi
start=$(date +%s)
mkdir -p build-san
log=build-san/sanitize-build.log
if [ ! -f build-san/CMakeCache.txt ]; then
  CC=clang CXX=clang++ cmake -S . -B build-san -DCMAKE_BUILD_TYPE=Release -DTURBOSPARK_FUZZ=ON \
    -DTURBOSPARK_TESTS=ON -DTURBOSPARK_NATIVE=ON >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
fi
harnesses=(gguf safetensors safetensors_index chat_template config tokenizer request)
targets=(turbospark_unit_tests turbospark_golden_tests fuzzers)
for h in "${harnesses[@]}"; do targets+=("fuzz_replay_$h"); done
if ! cmake --build build-san -j"$jobs" --target "${targets[@]}" >>"$log" 2>&1; then
  grep -E 'error|Error' "$log" >&2 || tail -50 "$log" >&2
  exit 1
fi
echo "sanitize: built in $(( $(date +%s) - start ))s" >&2
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
(cd build-san && ctest --output-on-failure -j"$jobs" --timeout 900 -L 'unit|golden' -LE slow)
echo "sanitize: ASan + UBSan suite passed at $(( $(date +%s) - start ))s" >&2
if [ "$seconds" -gt 0 ]; then
  mkdir -p build-san/fuzz-crashes
  for h in "${harnesses[@]}"; do
    mkdir -p "build-san/fuzz-corpus/$h"
    flog="build-san/fuzz-$h.log"
    if ! build-san/fuzz_"$h" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=4096 -timeout=30 \
         -artifact_prefix="build-san/fuzz-crashes/$h-" "build-san/fuzz-corpus/$h" "tests/fuzz/corpus/$h" >"$flog" 2>&1; then
      echo "sanitize: fuzz_$h found a crash (build-san/fuzz-crashes/, log $flog):" >&2
      grep -E 'ERROR|SUMMARY|==[0-9]+==' "$flog" | head -20 >&2
      exit 1
    fi
    echo "sanitize: fuzz_$h: $(grep -Eo 'Done [0-9]+ runs' "$flog" | head -1) in ${seconds}s, no crash" >&2
  done
fi
echo "sanitize: done in $(( $(date +%s) - start ))s" >&2
