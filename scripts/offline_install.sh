#!/usr/bin/env bash
# Installs this bundle (made by vllm-accel's scripts/offline_bundle.sh) with no
# network: vLLM 0.33.0 (pure Python), vllm-accel and the dependencies the host
# lacked, all from wheels/ with `pip install --no-index --no-deps`. The host's
# torch (and triton, torchvision, nvidia-*) is used as it is, never touched.
#
#   bash install.sh                 into the environment of python3
#   bash install.sh --target DIR    into DIR only; then use PYTHONPATH=DIR
#   options: --python PY (the interpreter to install for; default python3)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
py=python3 target=""
while (($#)); do
  case $1 in
    --target) target=${2:?}; shift 2 ;;
    --python) py=${2:?}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
step() { echo "install: $*"; }

want=$(cat "$here/PYTHON")
got=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ $got != "$want" ]]; then
  echo "install: this bundle is for Python $want; $py is Python $got" >&2
  exit 1
fi

shopt -s nullglob
wheels=("$here"/wheels/*.whl)
for whl in "${wheels[@]}"; do
  case ${whl##*/} in
    torch-* | triton-* | torchvision-* | torchaudio-* | torchcodec-* | nvidia_* | nvidia-*)
      echo "install: refusing ${whl##*/}: the host's torch stack is never replaced" >&2
      exit 1 ;;
  esac
done
torch_version() {
  "$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none
}
torch_before=$(torch_version)

# Bytecode is compiled once, below, with the final paths in it.
pip_args=(--disable-pip-version-check --no-index --no-deps --no-compile)
if [[ -n $target ]]; then
  mkdir -p "$target"
  target=$(cd "$target" && pwd)
  step "${#wheels[@]} wheels into $target"
  "$py" -m pip install "${pip_args[@]}" --upgrade --target "$target" "${wheels[@]}"
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
else
  step "${#wheels[@]} wheels into $("$py" -c 'import sys; print(sys.prefix)')"
  "$py" - "${wheels[@]}" <<'EOF'
import importlib.metadata as md
import sys
from pathlib import Path

for whl in map(Path, sys.argv[1:]):
    name, version = whl.name.split("-")[:2]
    try:
        old = md.version(name)
    except md.PackageNotFoundError:
        continue
    if old != version:
        print(f"install: replacing the host's {name} {old} with {version}")
EOF
  "$py" -m pip install "${pip_args[@]}" "${wheels[@]}"
fi

# Hosts like ours set PYTHONDONTWRITEBYTECODE=1: without .pyc files every
# `vllm serve` start takes twice as long.
step "compiling bytecode"
if [[ -n $target ]]; then
  roots=("$target")
else
  # Only what came from this bundle: never the host's torch or the like.
  mapfile -t roots < <("$py" - "$here/wheels" <<'EOF'
import importlib.metadata as md
import sys
from pathlib import Path

roots = set()
for whl in Path(sys.argv[1]).glob("*.whl"):
    dist = md.distribution(whl.name.split("-")[0])
    for f in dist.files or []:
        if f.suffix == ".py" and f.parts[0] != ".." and not f.parts[0].endswith(".data"):
            roots.add(str(dist.locate_file(f.parts[0])))
print("\n".join(sorted(roots)))
EOF
  )
fi
"$py" -m compileall -q -j 0 "${roots[@]}" >/dev/null ||
  echo "install: warning: some files did not compile (run '$py -m compileall -q ${roots[*]}' to see them)"

step "checking"
"$py" - "$here/wheels" "$target" <<'EOF'
import importlib.metadata as md
import json
import sys
from pathlib import Path

wheels, target = Path(sys.argv[1]), sys.argv[2]
manifest = json.loads((wheels.parent / "manifest.json").read_text())
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

# vLLM finds its platform plugin through entry points only.
if target:
    infos = list(Path(target).glob("vllm_accel-*.dist-info/entry_points.txt"))
    if not infos:
        sys.exit(f"install: no vllm_accel-*.dist-info/entry_points.txt in {target}")
for group in ("vllm.platform_plugins", "vllm.general_plugins"):
    found = [ep.value for ep in md.entry_points(group=group) if ep.name == "accel"]
    if not found:
        sys.exit(f"install: entry point 'accel' in {group} not found")
    print(f"install: entry point {group}: accel = {found[0]}")

# The requirements of what was installed that the host does not meet
# (torch: the host's own, expected to differ from the pin vllm-accel names).
bundled = {canonicalize_name(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
for name in sorted(bundled):
    for line in md.requires(name) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            why = manifest["skipped"].get(canonicalize_name(req.name), "")
            if not why.startswith("not needed at run time"):
                print(f"install: warning: {name} requires {req}, which is not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            print(f"install: note: {name} requires {req}; the host has {version}")
EOF

torch_after=$(torch_version)
if [[ $torch_before != "$torch_after" ]]; then
  echo "install: torch changed from $torch_before to $torch_after" >&2
  exit 1
fi
step "done: $("$py" -c 'import torch, vllm, vllm_accel, importlib.metadata as m
print("torch", torch.__version__, "| vllm", vllm.__version__, "| vllm-accel", m.version("vllm-accel"))')"
if [[ -n $target ]]; then
  step "use it with: export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
fi
