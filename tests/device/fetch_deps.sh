#!/usr/bin/env bash
# Downloads (does not install) the Debian packages a CUDA build of turbospark needs into
# .devdeps/, so tests/device/run.sh can build on a GPU machine that has CMake and nvcc but
# none of our libraries and no network: run.sh unpacks them with dpkg -x into a prefix.
# Run on a machine with apt (the CPU machines); carry .devdeps to the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devdeps
cd .devdeps
apt-get download libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libpcre2-dev libpcre2-8-0 \
  libgtest-dev liburing-dev liburing2 >/dev/null
ls -1 *.deb
