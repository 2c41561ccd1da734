#!/usr/bin/env bash
# Build one compressed bundle that installs vLLM 0.33.0 + vllm-accel on an
# accelerator host WITHOUT network, for a named target (Python version and
# platform tag). Run on a machine that reaches the package registries, after
# scripts/install.sh (its .venv/ gives the build tools and the versions to pin).
#
#   bash scripts/offline_bundle.sh --python 3.12 --platform manylinux_2_28_x86_64 \
#     [--have target-freeze.txt] [--out DIR]
#
# --have FILE: the target's `pip list --format=freeze`; every distribution
#   named there is left out (with what it depends on), unless the bundle
#   requires a version it does not have. Without it, a default list is left
#   out: what the H100 host of FACTS.md section 8 has (torch, triton,
#   transformers, tokenizers, huggingface-hub, safetensors, numpy, pillow,
#   opencv, einops, tiktoken, httpx, aiohttp, prometheus-client, psutil).
# torch, triton, torchvision, torchaudio, torchcodec and nvidia-* are never
#   bundled: the target keeps its own torch.
# --out DIR: where the bundle goes (default: .bundle/ in the repository).
# --full: keep the few declared dependencies that nothing imports at run time
#   (fastapi-cli, fastapi-cloud-cli, fastar, hf-xet: see offline_bundle.py).
#
# The bundle, <out>/vllm-accel-bundle-<python>-<platform>.tar.xz, holds:
#   wheels/      vLLM built from source as pure Python (as scripts/install.sh
#                does), vllm-accel, and the wheels of their runtime
#                dependencies for the target, pinned to .venv's versions
#   install.sh   on the target: `bash install.sh [--target DIR]` (no network)
#   manifest.json  what is in it, what was left to the target, and why
# Wheels are stored uncompressed inside and the whole is one xz -9 stream:
# that compresses across files, ~40% smaller than xz over deflated wheels;
# gzip would be ~2x larger for a few seconds less.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
py="$repo/.venv/bin/python"
usage() { sed -n '7,8p' "$0" | sed 's/^#  *//'; }
step() { echo "bundle: $*"; }

pyver="" plat="" have="" out="$repo/.bundle" full=()
while (($#)); do
  case $1 in
    --python) pyver=${2:?}; shift 2 ;;
    --platform) plat=${2:?}; shift 2 ;;
    --have) have=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --full) full=(--full); shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bundle: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z $pyver || -z $plat ]]; then
  usage >&2
  exit 2
fi
if [[ ! $pyver =~ ^3\.[0-9]+(\.[0-9]+)?$ ]]; then
  echo "bundle: --python wants a version such as 3.12, not $pyver" >&2
  exit 2
fi
if [[ ! -f "$repo/.venv/.vllm-accel-installed" ]]; then
  echo "bundle: no complete .venv/: run 'bash scripts/install.sh' first" >&2
  exit 1
fi

start=$SECONDS
name="vllm-accel-bundle-$pyver-$plat"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage="$work/$name"
wheels="$stage/wheels"
mkdir -p "$wheels" "$out"
out=$(cd "$out" && pwd)
have_args=()
if [[ -n $have ]]; then
  cp "$have" "$work/have.txt" # also reads a <(...) pipe once
  have_args=(--have "$work/have.txt")
fi

# vllm_build_env and vllm_source (certifi relaxed, cargo kept off PATH).
source "$repo/scripts/vllm_source.sh"
step "vLLM 0.33.0 wheel from source (VLLM_TARGET_DEVICE=empty, certifi relaxed)"
mkdir "$work/src"
vllm_source "$py" "$work/src" bundle
"${vllm_build_env[@]}" "$py" -m pip wheel --disable-pip-version-check -q \
  --no-deps --no-build-isolation -w "$work/src" "$work/src/vllm-0.33.0"
"$py" "$repo/scripts/offline_bundle.py" retag "$work/src"/vllm-0.33.0-*.whl >/dev/null
mv "$work/src/vllm-0.33.0-py3-none-any.whl" "$wheels/"

# Built from a copy of the working tree (tracked and untracked, not ignored
# files), so that no build/ or stale egg-info of the checkout gets in.
step "vllm-accel wheel (working tree)"
mkdir "$work/accel"
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  (cd "$repo" && while IFS= read -r -d '' f; do [[ -f $f ]] && printf '%s\0' "$f"; done) |
  tar -C "$repo" --null -T - -cf - | tar -C "$work/accel" -xf -
"$py" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation \
  -w "$wheels" "$work/accel"

step "runtime dependencies for Python $pyver, $plat"
"$py" "$repo/scripts/offline_bundle.py" resolve --python "$pyver" --platform "$plat" \
  "${have_args[@]}" "${full[@]}" --wheels "$wheels" --manifest "$stage/manifest.json" \
  "$wheels"/vllm-0.33.0-py3-none-any.whl "$wheels"/vllm_accel-*.whl
"$py" "$repo/scripts/offline_bundle.py" repack "$wheels"/*.whl

install -m 0755 "$repo/scripts/offline_install.sh" "$stage/install.sh"
echo "$pyver" | cut -d. -f1,2 >"$stage/PYTHON"

step "compressing (xz -9)"
tar -C "$work" --owner=0 --group=0 --sort=name -cf - "$name" | xz -9 -T1 >"$out/$name.tar.xz.tmp"
mv "$out/$name.tar.xz.tmp" "$out/$name.tar.xz"

count=$(find "$wheels" -name '*.whl' | wc -l)
unpacked=$(du -sm "$stage" | cut -f1)
size=$(stat -c %s "$out/$name.tar.xz")
step "$out/$name.tar.xz: $(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1e6 }') MB" \
  "($count wheels, ${unpacked} MB unpacked; built in $((SECONDS - start)) s)"
step "on the target: tar -xJf $name.tar.xz && bash $name/install.sh [--target DIR]"
