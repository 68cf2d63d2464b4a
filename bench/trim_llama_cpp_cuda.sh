#!/usr/bin/env bash
# Packs the part of llama.cpp that `llama-bench` with the CUDA backend needs into one small
# tarball (~2.5 MB) that can travel to the GPU machine, which has nvcc and CMake but no
# network; bench/cuda_vs_llama_cpp.sh builds it there (LLAMA_SRC_TAR=...) on all its cores
# (232 s on the H200 machine's 16; a CUDA build on this 2-core VM did not finish in 45 min).
#
# The tree comes from the llama-cpp-python sdist on PyPI (vendor/llama.cpp), unpacked OUTSIDE
# the repo; nothing of llama.cpp is copied into the repo.
#
#   bench/trim_llama_cpp_cuda.sh OUT.tar.xz
#
#   LLAMA_WITH_SERVER=1 bench/trim_llama_cpp_cuda.sh OUT.tar.xz   # llama-server too
#
# Kept: the top-level CMake files, cmake/, src/, include/, common/, vendor/, licenses, ggml/
# minus the backends this build does not use, and tools/llama-bench with a tools/CMakeLists.txt
# that adds only it. Configure it with -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF
# -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF (cuda_vs_llama_cpp.sh does).
set -euo pipefail
out="${1:?usage: trim_llama_cpp_cuda.sh OUT.tar.xz}"
version="${LLAMA_CPP_PY_VERSION:-0.3.36}"
work="${TURBOSPARK_LLAMA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turbospark/llama-trim-$version}"
mkdir -p "$work"
sdist="$work/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
fi
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[[ -d "$src" ]] || tar xzf "$sdist" -C "$work"
stage="$work/stage"
rm -rf "$stage" && mkdir -p "$stage/llama.cpp/tools" "$stage/llama.cpp/ggml/src"
cp -r "$src"/{CMakeLists.txt,cmake,src,include,common,vendor,licenses,LICENSE} "$stage/llama.cpp/"
cp -r "$src"/ggml/{CMakeLists.txt,cmake,include} "$stage/llama.cpp/ggml/"
(cd "$src/ggml/src" && tar cf - --exclude=ggml-vulkan --exclude=ggml-sycl --exclude=ggml-metal \
  --exclude=ggml-opencl --exclude=ggml-cann --exclude=ggml-musa --exclude=ggml-hip --exclude=ggml-webgpu \
  --exclude=ggml-kompute --exclude=ggml-zdnn --exclude=ggml-hexagon --exclude=ggml-openvino .) |
  (cd "$stage/llama.cpp/ggml/src" && tar xf -)
cp -r "$src/tools/llama-bench" "$stage/llama.cpp/tools/"
echo 'add_subdirectory(llama-bench)' >"$stage/llama.cpp/tools/CMakeLists.txt"
if [[ "${LLAMA_WITH_SERVER:-0}" == 1 ]]; then
  # llama-server (the serving peer of bench/serve_bench.py) and what it links: the web UI's
  # assets target and mtmd. Configure with -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF.
  cp -r "$src"/tools/{server,ui,mtmd} "$stage/llama.cpp/tools/"
  mkdir -p "$stage/llama.cpp/scripts" && cp "$src/scripts/ui-assets.cmake" "$stage/llama.cpp/scripts/"
  printf 'add_subdirectory(ui)\nadd_subdirectory(mtmd)\nadd_subdirectory(server)\n' \
    >>"$stage/llama.cpp/tools/CMakeLists.txt"
fi
tar cJf "$out" -C "$stage" llama.cpp
echo "$out: $(du -h "$out" | cut -f1)" >&2
