#!/usr/bin/env bash
# One Qwen4-Exp GGUF in both engines. A tiny random checkpoint, converted by llama.cpp's own
# converter (tools/fixtures/make_qwen4exp_llama_cpp_pair.py): turbospark on the checkpoint and
# on the GGUF against transformers' logits, then turbospark against llama.cpp on the GGUF
# (bench/agreement_llama_cpp.sh: perplexity, KL divergence and top-1 agreement on the same ids,
# and llama.cpp's own noise floor).
#
#   PYTHON=venv/bin/python3 CONVERTER=DIR bench/qwen4exp_llama_cpp_agreement.sh [TEXT] [CTX] [CHUNKS]
#
# PYTHON needs torch and transformers (>= 5.17); CONVERTER holds llama.cpp's
# convert_hf_to_gguf.py, conversion/ and gguf-py/ (the llama-cpp-python sdist's vendor/llama.cpp);
# LLAMA_BIN as for bench/agreement_llama_cpp.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
conv="${CONVERTER:?set CONVERTER to the folder of llama.cpp convert_hf_to_gguf.py, conversion/ and gguf-py/}"
text="${1:-README.md}"
ctx="${2:-128}"
chunks="${3:-4}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" tools/fixtures/make_qwen4exp_llama_cpp_pair.py --converter "$conv" --out "$work" >"$work/make.log" 2>&1 ||
  { tail -n 20 "$work/make.log" >&2; exit 1; }
tokens=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['tokens'])))" "$work/tokens.json")
build/turbospark logits -m "$work/ckpt" --tokens "$tokens" --out "$work/ckpt.npy" --device cpu
build/turbospark logits -m "$work/qwen4exp-bf16.gguf" --tokens "$tokens" --out "$work/gguf.npy" --device cpu
python3 - "$work" <<'PY'
import sys
import numpy as np
w = sys.argv[1]
hf, st, gg = (np.load(f"{w}/{n}.npy") for n in ("hf_logits", "ckpt", "gguf"))
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
print(f"== turbospark vs transformers: checkpoint {rel(st, hf):.2e}, GGUF {rel(gg, hf):.2e} (max error over the largest logit)")
PY
FLOOR=1 bench/agreement_llama_cpp.sh "$work/qwen4exp-bf16.gguf" "$text" "$ctx" "$chunks"
