#!/usr/bin/env python3
"""Torchvision shims for the native vLLM CPU venv (.bench-venv), without installing vllm-accel.

vLLM's LlavaNext model module imports a transformers module that needs torchvision (none on
these machines), and vLLM inspects the model in a subprocess: without a shim in every process,
vLLM's own CPU build cannot load LlavaNext at all ("Model architectures
['LlavaNextForConditionalGeneration'] failed to be inspected ... No module named 'torchvision'").
vllm-accel installs the shims (vllm_accel/patches.py) through its general plugin; the
native venv must not get that plugin (it would register our platform there too). Instead this
writes two files into the venv's site-packages:

  vllm_accel_bench_shims.pth   one line, "import _vllm_accel_bench_shims" (site runs it at every
                               interpreter start of that venv, so in every vLLM process)
  _vllm_accel_bench_shims.py   loads vllm_accel/patches.py from this checkout (its path fixed at
                               install time) as module "_vllm_accel_bench.patches" (vllm_accel's
                               folder as package "_vllm_accel_bench", its __init__ not run) and
                               calls apply_patches(): an import hook, dormant until transformers'
                               pixtral/video modules are imported, inactive if torchvision is there

Only that venv's interpreter reads its site-packages' .pth files. VLLM_BENCH_NO_SHIMS=1 turns
the shim off for one run (to see the failure it fixes).

    python benchmarks/native_shims.py [install|remove|check] [--venv .bench-venv]
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMPAT = REPO / "vllm_accel" / "patches.py"
DEFAULT_VENV = REPO / ".bench-venv"
PTH_NAME = "vllm_accel_bench_shims.pth"
MODULE = "_vllm_accel_bench_shims"
COMPAT_PACKAGE = "_vllm_accel_bench"
COMPAT_MODULE = COMPAT_PACKAGE + ".patches"

MODULE_SOURCE = '''\
"""Written by benchmarks/native_shims.py (vllm-accel checkout {repo}), loaded by {pth}.

Torchvision shims for vLLM's native CPU build in this venv only: loads vllm-accel's
vllm_accel/patches.py as {compat_module} and calls apply_patches(). VLLM_BENCH_NO_SHIMS=1
disables it.
"""
import os
import sys

COMPAT = {compat!r}
PACKAGE = {compat_package!r}


def _install():
    if PACKAGE in sys.modules or os.environ.get("VLLM_BENCH_NO_SHIMS", "") not in ("", "0"):
        return
    if not os.path.isfile(COMPAT):
        sys.stderr.write(f"[{{__name__}}] {{COMPAT}} is missing: torchvision shims not installed "
                         "(re-run benchmarks/native_shims.py)\\n")
        return
    import importlib
    import types

    # vllm_accel's folder as a package of another name (vllm_accel itself must not import
    # here): patches.py and the modules it imports relatively load from it, and the stand-in
    # video processor pickles by its module's name in every process of this venv.
    package = types.ModuleType(PACKAGE)
    package.__path__ = [os.path.dirname(COMPAT)]
    sys.modules[PACKAGE] = package
    try:
        importlib.import_module(PACKAGE + ".patches").apply_patches()
    except Exception as error:  # never break interpreter start-up
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        sys.stderr.write(f"[{{__name__}}] torchvision shims not installed: {{error!r}}\\n")


_install()
'''


def log(msg):
    print(f"[native_shims] {msg}", flush=True)


def site_packages(venv):
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Python at {python}: create the venv first "
                         "(benchmarks/setup_native_cpu.sh)")
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def wanted_files():
    source = MODULE_SOURCE.format(repo=str(REPO), pth=PTH_NAME, compat=str(COMPAT),
                                  compat_module=COMPAT_MODULE, compat_package=COMPAT_PACKAGE)
    return {PTH_NAME: f"import {MODULE}\n", f"{MODULE}.py": source}


def install(venv=DEFAULT_VENV, quiet=False):
    """Write (or refresh) the two files; returns True if anything changed. Idempotent."""
    if not COMPAT.exists():
        raise SystemExit(f"{COMPAT} not found")
    site = site_packages(venv)
    changed = False
    for name, text in wanted_files().items():
        path = site / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed = True
    if changed or not quiet:
        log(f"torchvision shims {'installed' if changed else 'already in place'} in {site} "
            f"({PTH_NAME} -> {COMPAT})")
    return changed


def remove(venv=DEFAULT_VENV):
    site = site_packages(venv)
    for name in wanted_files():
        (site / name).unlink(missing_ok=True)
    log(f"removed {PTH_NAME} and {MODULE}.py from {site}")


def check(venv=DEFAULT_VENV):
    """The shim is active in the venv (in a fresh interpreter and a subprocess of it) and
    resolves the pixtral module; vllm_accel is not importable there."""
    python = str(Path(venv) / "bin" / "python")
    code = (
        "import importlib.util, subprocess, sys\n"
        f"assert {COMPAT_MODULE!r} in sys.modules, 'shim not loaded'\n"
        "assert importlib.util.find_spec('vllm_accel') is None, 'vllm_accel importable'\n"
        "from transformers.models.pixtral.image_processing_pixtral import _num_image_tokens\n"
        "print('pixtral alias ->', _num_image_tokens.__module__)\n"
        f"sub = subprocess.run([sys.executable, '-c', \"import sys; print({COMPAT_MODULE!r} "
        "in sys.modules)\"], capture_output=True, text=True).stdout.strip()\n"
        "print('subprocess has the shim:', sub)\n"
        "assert sub == 'True'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BENCH_NO_SHIMS"}
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tempfile.gettempdir())  # not the checkout: vllm_accel would import
    sys.stdout.write(r.stdout)
    if r.returncode:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"check failed in {venv}")
    log(f"check passed in {venv}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", nargs="?", default="install", choices=["install", "remove", "check"])
    p.add_argument("--venv", default=str(DEFAULT_VENV))
    a = p.parse_args()
    {"install": install, "remove": remove, "check": check}[a.action](a.venv)


if __name__ == "__main__":
    main()
