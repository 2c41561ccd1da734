#!/usr/bin/env bash
# Set up .venv/ on a bare machine (Python 3.11 + the package registries):
# torch 2.13.0 CPU, vLLM 0.33.0 built as pure Python, vllm-accel (editable) and
# its test tools. A re-run with a complete .venv/ only re-checks and exits.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)
marker="$venv/.vllm-accel-installed"
fingerprint=$(cat "$repo/scripts/install.sh" "$repo/scripts/vllm_source.sh" "$repo/pyproject.toml" |
  sha256sum | cut -d' ' -f1)

if [[ -f "$marker" && "$(cat "$marker")" == "$fingerprint" ]]; then
  echo "install: .venv is complete (delete $marker to force a re-install)"
  exit 0
fi

step() { echo "install: $*"; }

if [[ ! -x "$py" ]]; then
  step "creating $venv"
  python3.11 -m venv "$venv"
fi

# A plain torch requirement would pull the registry's CUDA build: pin the CPU one.
step "torch 2.13.0 (CPU)"
"${pip[@]}" torch==2.13.0

step "build tools for vLLM"
"${pip[@]}" "setuptools>=77.0.3,<81" "setuptools-scm>=8" "setuptools-rust>=1.9" \
  wheel jinja2 "packaging>=24.2" ninja cmake

# vllm_build_env and vllm_source (certifi relaxed, cargo kept off PATH).
source "$repo/scripts/vllm_source.sh"

vllm_built_here() {
  "$py" - <<'EOF'
import importlib.metadata as md
import sys

try:
    ok = md.version("vllm") == "0.33.0" and "certifi" in (md.requires("vllm") or [])
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

if ! vllm_built_here; then
  step "vLLM 0.33.0 from source (VLLM_TARGET_DEVICE=empty, certifi relaxed, ~1-2 min)"
  src=$(mktemp -d)
  vllm_source "$py" "$src" install
  "${vllm_build_env[@]}" "${pip[@]}" --no-build-isolation --no-deps --force-reinstall "$src/vllm-0.33.0"
  rm -rf "$src"
  if ! vllm_built_here; then
    echo "install: the built vLLM is not 0.33.0 with a relaxed certifi requirement" >&2
    exit 1
  fi
fi

# vLLM's own requirements, read from its metadata (extras dropped).
step "vLLM's requirements and vllm-accel's"
reqs=$(mktemp)
"$py" - "$repo/pyproject.toml" >"$reqs" <<'EOF'
import importlib.metadata as md
import sys
import tomllib

from packaging.requirements import Requirement

for line in md.requires("vllm"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for line in project["dependencies"] + project["optional-dependencies"]["test"]:
    if Requirement(line).name not in ("vllm", "torch"):
        print(line)
EOF
"${pip[@]}" -r "$reqs" torch==2.13.0
rm -f "$reqs"

step "vllm-accel (editable)"
"${pip[@]}" --no-deps --no-build-isolation -e "$repo"

# torchvision/torchaudio/torchcodec exist on the registry only as CUDA builds
# that break imports on CPU torch (and transformers tries torchvision).
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if "$py" -m pip list 2>/dev/null | grep -i -E '^(nvidia-|torchvision|torchaudio|torchcodec)'; then
  echo "install: CUDA/vision packages crept in (listed above)" >&2
  exit 1
fi

# These machines set PYTHONDONTWRITEBYTECODE=1; without .pyc files every
# `vllm serve` start costs ~25 s more.
step "compiling bytecode"
"$py" -m compileall -q -j 0 "$venv/lib" >/dev/null || true

echo "$fingerprint" >"$marker"
step "done: $("$py" -c 'import torch, vllm; print("torch", torch.__version__, "| vllm", vllm.__version__)')"
