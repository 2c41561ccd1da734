# Sourced (not run) by scripts/install.sh and scripts/offline_bundle.sh: how
# vLLM 0.33.0 is fetched as source and built as pure Python.

# Hardware plugins build vLLM from source with no device code. Its optional
# Rust part needs crates.io, which is unreachable: keep cargo off PATH.
# (pip download runs setup.py for the metadata too: same environment.)
# Without VLLM_SKIP_VERSION_SUFFIX the build is "0.33.0+empty", and pip then
# refuses it as vllm==0.33.0.
vllm_build_env=(env PATH="$(tr ':' '\n' <<<"$PATH" | grep -v -e cargo -e rustup | paste -sd: -)"
  VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1)

# vllm_source PYTHON DIR TAG: download vLLM 0.33.0's source archive into DIR
# (pip of PYTHON, which needs the build tools: no build isolation), unpack it
# to DIR/vllm-0.33.0 and relax its certifi requirement. TAG prefixes errors.
#
# vLLM 0.33.0's requirements/common.txt asks for certifi>=2026.10.19, a release
# the registry does not have (newest: 2026.10.18). We relax that one line in
# the unpacked source before building, so the installed vLLM's metadata says
# what is really installed and pip's dependency check agrees with it.
vllm_source() {
  local py=$1 dir=$2 tag=$3
  "${vllm_build_env[@]}" "$py" -m pip download --disable-pip-version-check -q \
    --no-deps --no-binary :all: --no-build-isolation -d "$dir" vllm==0.33.0
  tar -xzf "$dir/vllm-0.33.0.tar.gz" -C "$dir"
  local common="$dir/vllm-0.33.0/requirements/common.txt"
  sed -i -E 's/^certifi *>= *2026\.10\.19 *$/certifi/' "$common"
  if ! grep -qx certifi "$common"; then
    echo "$tag: vLLM's requirements/common.txt no longer has the expected" \
      "'certifi >= 2026.10.19' line; update scripts/vllm_source.sh" >&2
    return 1
  fi
}
