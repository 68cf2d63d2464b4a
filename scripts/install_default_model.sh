#!/usr/bin/env bash
# Installs the default model where `turbospark run` finds it without --model:
# ${XDG_DATA_HOME:-~/.local/share}/turbospark/default-model.
#
# Until a real trained model lands (issue: real models out of the box), the default is the
# committed tiny random Qwen3 checkpoint with a tiny trained BPE vocabulary: it runs the
# whole pipeline end to end but its answers are random text.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${XDG_DATA_HOME:-$HOME/.local/share}/turbospark"
mkdir -p "$data"
rm -rf "$data/default-model"
cp -r tests/data/fixtures/qwen3_tiny "$data/default-model"
cp tests/data/tiny_tokenizer/tokenizer.json tests/data/tiny_tokenizer/tokenizer_config.json "$data/default-model/"
echo "setup: default model installed at $data/default-model (tiny random Qwen3 test checkpoint)" >&2
