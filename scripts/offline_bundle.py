"""Helper of scripts/offline_bundle.sh (run with .venv's python).

resolve: starting from the Requires-Dist of the two wheels built here (vLLM
and vllm-accel), walk the runtime dependency tree as the TARGET would see it
(its Python version and machine in every environment marker), fetch each
wheel for the target with `pip download --no-deps --only-binary=:all:`
pinned to the version installed in .venv (what CI tests), and skip:
  - the target's torch stack, always (torch, triton, torchvision, torchaudio,
    torchcodec, nvidia-*): the target keeps its own;
  - what the target already has (--have: its `pip list --format=freeze`;
    else DEFAULT_HAVE), and what those distributions need in turn (pip
    installed it with them). Not what DEFAULT_HAVE's distributions need per
    .venv's metadata: newer releases need more (huggingface-hub 2.x: typer,
    httpx2; typer: pydantic), which an older target may lack;
  - NOT_AT_RUNTIME (unless --full): declared, but never imported.
A distribution the target has at a version that violates a requirement of
what we bundle is bundled anyway, at .venv's version, and said so.
A distribution with no wheel for the target (a source archive only) is built
here with `pip wheel`; that must give a pure-Python wheel.

retag: vLLM's pure-Python build is tagged for this interpreter: make it
py3-none-any.

repack: rewrite wheels with stored (uncompressed) zip members, so that the
bundle's single xz stream compresses across all files (~40% smaller than xz
over deflated wheels). Members, their order, RECORD and hashes are unchanged.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# Never bundled: the target's own torch and what comes with it.
NEVER = {"torch", "triton", "pytorch-triton", "torchvision", "torchaudio", "torchcodec"}
NEVER_PREFIXES = ("nvidia-",)

# Without --have: what the accelerator host of FACTS.md section 8 has (versions
# where known). opencv: vLLM asks for the headless build; either provides cv2.
# huggingface-hub: that host's transformers 5.17 refuses hub 2.x at import
# (seen there with the 2.4.0 .venv has); its own 1.33.0 meets vLLM's >=1.31.
DEFAULT_HAVE = {
    "torch": "2.11.0",
    "triton": None,
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": None,
    "numpy": None,
    "pillow": None,
    "opencv-python": None,
    "opencv-python-headless": None,
    "einops": None,
    "tiktoken": None,
    "httpx": None,
    "aiohttp": None,
    "prometheus-client": None,
    "psutil": None,
}


# Left out unless --full: declared dependencies that vLLM and vllm-accel never
# import at run time (checked: `import vllm.entrypoints.openai.api_server`
# and the MCP tool server import without them).
NOT_AT_RUNTIME = {
    "fastapi-cli": "the `fastapi` developer command (from fastapi[standard]); vLLM runs uvicorn itself",
    "fastapi-cloud-cli": "FastAPI Cloud's deploy command (from fastapi[standard])",
    "fastar": "archives for FastAPI Cloud deploys (from fastapi[standard]); nothing imports it",
    "hf-xet": "Hugging Face Hub transfers (xet storage); an offline host downloads nothing",
}


def never(name: str) -> bool:
    return name in NEVER or name.startswith(NEVER_PREFIXES)


def log(msg: str) -> None:
    print(f"bundle: {msg}", file=sys.stderr, flush=True)


def read_have(path: str | None) -> dict[str, str | None]:
    if path is None:
        return dict(DEFAULT_HAVE)
    have: dict[str, str | None] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;#]+))?", line)
        if m:
            have[canonicalize_name(m.group(1))] = m.group(2)
    return have


def platforms(tag: str) -> list[str]:
    """pip matches --platform exactly (except manylinux2014/2010 and macOS):
    list every older glibc/musl tag the target accepts too, newest first."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    if m:
        minor, arch = int(m.group(1)), m.group(2)
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        out = []
        for v in range(minor, 4, -1):
            if v < 17 and arch not in ("x86_64", "i686"):
                break
            out.append(f"manylinux_2_{v}_{arch}")
            if v in legacy:
                out.append(f"{legacy[v]}_{arch}")
        return out
    m = re.fullmatch(r"musllinux_1_(\d+)_(\w+)", tag)
    if m:
        return [f"musllinux_1_{v}_{m.group(2)}" for v in range(int(m.group(1)), -1, -1)]
    return [tag]


def machine(tag: str) -> str:
    for arch in ("x86_64", "aarch64", "ppc64le", "s390x", "i686", "armv7l"):
        if tag.endswith(arch):
            return arch
    sys.exit(f"bundle: cannot tell the machine of platform tag {tag!r}")


def marker_env(pyver: str, tag: str) -> dict[str, str]:
    if not tag.startswith(("manylinux", "musllinux", "linux")):
        sys.exit(f"bundle: only Linux platform tags are supported, not {tag!r}")
    full = pyver if pyver.count(".") == 2 else pyver + ".0"
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": machine(tag),
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": ".".join(full.split(".")[:2]),
        "sys_platform": "linux",
    }


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = HeaderParser().parsestr(z.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def venv_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def satisfies(version: str, spec: SpecifierSet) -> bool:
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def target_requires(have: dict[str, str], args: argparse.Namespace) -> dict[str, list[str]]:
    """Requires-Dist of the target's own distributions at the target's
    versions, read from the index's metadata (`pip install --dry-run
    --report`: no wheel is downloaded where the index serves metadata)."""
    def report(pins: list[str]) -> list[dict] | None:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                   "--dry-run", "--ignore-installed", "--ignore-requires-python", "--no-deps",
                   "--only-binary=:all:", "--python-version", args.python,
                   "--target", f"{tmp}/t", "--report", f"{tmp}/report.json"]
            for p in platforms(args.platform):
                cmd += ["--platform", p]
            if subprocess.run(cmd + pins, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
                return None
            return json.loads(Path(f"{tmp}/report.json").read_text())["install"]

    pins = [f"{n}=={v}" for n, v in sorted(have.items())]
    items = report(pins)
    if items is None:
        items = []
        for pin in pins:
            one = report([pin])
            if one is None:
                log(f"cannot read the requirements of the target's {pin}: not taken into account")
            items += one or []
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"].get("requires_dist") or []
            for i in items}


class Resolver:
    def __init__(self, args: argparse.Namespace, constraints: dict[str, list[str]]) -> None:
        self.args = args
        self.env = marker_env(args.python, args.platform)
        self.have = read_have(args.have)
        self.dropped = {} if args.full else dict(NOT_AT_RUNTIME)
        self.wheels = Path(args.wheels)
        self.edges: dict[str, dict[tuple[str, str], None]] = {}  # name -> {(spec, parent)}
        # What the target's own distributions require constrains what we bundle
        # (its transformers 5.17 wants huggingface-hub<2: .venv's 2.x would break it).
        for have, lines in constraints.items():
            for line in lines:
                req = self.wanted(line, set())
                if req is not None and req.specifier:
                    parent = f"the target's {have} {self.have[have]}"
                    self.edges.setdefault(canonicalize_name(req.name), {})[(str(req.specifier), parent)] = None
        self.reached: set[str] = set()
        self.extras: dict[str, set[str]] = {}  # bundled name -> extras processed
        self.bundle: dict[str, dict] = {}  # name -> {version, file, pinned}
        self.skipped: dict[str, str] = {}
        self.upgraded: dict[str, str] = {}
        self.local: dict[str, Path] = {}
        for whl in args.local:
            name, version, _, _ = parse_wheel_filename(Path(whl).name)
            self.local[name] = Path(whl)
            self.bundle[name] = {"version": str(version), "file": Path(whl).name, "source": "built here"}

    def wanted(self, line: str, extras: set[str]) -> Requirement | None:
        req = Requirement(line)
        if req.marker is None:
            return req
        for extra in {""} | extras:
            if req.marker.evaluate({**self.env, "extra": extra}):
                return req
        return None

    def spec(self, name: str) -> SpecifierSet:
        out = SpecifierSet()
        for s, _ in self.edges.get(name, {}):
            out &= SpecifierSet(s)
        return out

    def have_ok(self, name: str) -> bool:
        version = self.have.get(name)
        return version is None or all(satisfies(version, SpecifierSet(s)) for s, _ in self.edges[name])

    def run(self) -> None:
        # (requirement line, parent name, parent's extras)
        pending = [(line, name, set()) for name, whl in self.local.items() for line in wheel_requires(whl)]
        while pending:
            need: dict[str, set[str]] = {}
            for line, parent, parent_extras in pending:
                req = self.wanted(line, parent_extras)
                if req is None:
                    continue
                name = canonicalize_name(req.name)
                self.reached.add(name)
                self.edges.setdefault(name, {})[(str(req.specifier), parent)] = None
                if never(name):
                    self.skipped[name] = "the target's own torch stack"
                    continue
                if name in self.dropped:
                    self.skipped[name] = "not needed at run time: " + self.dropped[name]
                    continue
                if name in self.local:
                    continue
                if name in self.have and name not in self.bundle:
                    v = self.have[name]
                    if self.have_ok(name):
                        self.skipped[name] = f"the target has it{f' ({v})' if v else ''}"
                        continue
                    bad = [f"{s} ({p})" for s, p in self.edges[name] if s and not satisfies(v, SpecifierSet(s))]
                    self.upgraded[name] = f"the target's {v} does not satisfy {', '.join(bad)}"
                    self.skipped.pop(name, None)
                new = set(req.extras) - self.extras.get(name, set())
                if name not in self.bundle or new:
                    need.setdefault(name, set()).update(new)
            pending = []
            fresh = [n for n in need if n not in self.bundle]
            if fresh:
                self.fetch(fresh)
            for name, new in need.items():
                done = self.extras.setdefault(name, set())
                if name in fresh or new - done:
                    done |= new
                    whl = self.wheels / self.bundle[name]["file"]
                    pending += [(line, name, done) for line in wheel_requires(whl)]

    def fetch(self, names: list[str]) -> None:
        reqs = {}  # name -> (requirement, how it was chosen)
        for name in sorted(names):
            version = venv_version(name)
            spec = self.spec(name)
            if version is not None and satisfies(version, spec):
                reqs[name] = (f"{name}=={version}", "pinned to .venv")
            else:
                if version is not None:
                    log(f"{name}: .venv's {version} does not satisfy {spec}; taking the newest that does")
                else:
                    log(f"{name}: not in .venv (needed on the target only); taking the newest {spec or 'release'}")
                reqs[name] = (f"{name}{spec}", "newest (not in .venv)")
        log(f"downloading {len(reqs)} wheels: {' '.join(r for r, _ in reqs.values())}")
        failed = []
        if self.pip_download([r for r, _ in reqs.values()]) != 0:
            for name, (r, how) in list(reqs.items()):
                if self.pip_download([r]) == 0:
                    continue
                spec = self.spec(name)
                if r != f"{name}{spec}" and self.pip_download([f"{name}{spec}"]) == 0:
                    log(f"{r}: no wheel for the target; taking the newest that has one ({spec or 'any version'})")
                    reqs[name] = (f"{name}{spec}", "newest with a wheel for the target")
                    continue
                here = self.wheel_for_this_machine(r)
                if here is None:  # a source archive only: pure Python, hopefully
                    self.pip_wheel(r)
                    reqs[name] = (r, how + ", built here from its source archive")
                    continue
                failed.append((name, r, here))
        if failed:
            lines = []
            for name, r, here in failed:
                parents = sorted({p for _, p in self.edges[name]})
                lines.append(f"  {r} (for {', '.join(parents)}, which ask {name}{self.spec(name)}):"
                             f" no wheel for Python {self.args.python} on {self.args.platform};"
                             f" this machine gets {here}")
            sys.exit("bundle: cannot bundle\n" + "\n".join(lines) + "\n"
                     "bundle: a newer --platform (the target's glibc at least that wheel's) may do")
        found = {}
        for whl in self.wheels.glob("*.whl"):
            n, v, _, _ = parse_wheel_filename(whl.name)
            if n in reqs and SpecifierSet(reqs[n][0][len(n):]).contains(v, prereleases=True):
                found.setdefault(n, []).append(whl)
        for name, (r, how) in reqs.items():
            if name not in found:
                sys.exit(f"bundle: no wheel for {r} after download")
            whl = max(found[name], key=lambda p: parse_wheel_filename(p.name)[1])
            version = str(parse_wheel_filename(whl.name)[1])
            self.bundle[name] = {"version": version, "file": whl.name, "source": how}

    def pip_download(self, reqs: list[str], target: bool = True, dest: str | None = None) -> int:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
               "--no-deps", "--only-binary=:all:", "-d", dest or str(self.wheels)]
        if target:
            cmd += ["--python-version", self.args.python]
            for p in platforms(self.args.platform):
                cmd += ["--platform", p]
        return subprocess.run(cmd + reqs, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    def wheel_for_this_machine(self, req: str) -> str | None:
        with tempfile.TemporaryDirectory() as tmp:
            if self.pip_download([req], target=False, dest=tmp) != 0:
                return None
            return next(Path(tmp).glob("*.whl")).name

    def pip_wheel(self, req: str) -> None:
        log(f"{req}: no wheel at all; building one from its source archive")
        before = set(self.wheels.glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q",
                        "--no-deps", "-w", str(self.wheels), req], check=True)
        for whl in set(self.wheels.glob("*.whl")) - before:
            _, _, _, tags = parse_wheel_filename(whl.name)
            if not all(t.abi == "none" and t.platform == "any" for t in tags):
                sys.exit(f"bundle: {whl.name} is not pure Python: it cannot be built here for the target")

    def check(self) -> list[str]:
        """Requirements of bundled distributions that the bundle plus the
        target's (known) versions do not meet."""
        problems = []
        for name, edges in sorted(self.edges.items()):
            version = self.bundle.get(name, {}).get("version") or self.have.get(name)
            if version is None or name not in self.reached | set(self.bundle):
                continue
            for s, parent in edges:
                if s and not satisfies(version, SpecifierSet(s)):
                    where = "bundled" if name in self.bundle else "target's"
                    problems.append(f"{parent} requires {name}{s}; {where} {version}")
        return problems


def resolve(args: argparse.Namespace) -> None:
    # Resolve; read the requirements of the target's distributions that the
    # bundle relies on (where --have or DEFAULT_HAVE gives their version);
    # resolve again under those, until no new one turns up.
    constraints: dict[str, list[str]] = {}
    while True:
        r = Resolver(args, constraints)
        r.run()
        new = {n: r.have[n] for n in r.skipped
               if r.have.get(n) and not never(n) and n not in constraints}
        if not new:
            break
        log(f"reading the requirements of the target's {', '.join(f'{n} {v}' for n, v in new.items())}")
        got = target_requires(new, args)
        for n in new:
            constraints[n] = got.get(n, [])
        if not any(got.values()):
            break
    # Wheels left over from an earlier run into the same directory.
    keep = {b["file"] for b in r.bundle.values()}
    for whl in Path(args.wheels).glob("*.whl"):
        if whl.name not in keep:
            whl.unlink()
    problems = r.check()
    for name, why in sorted(r.upgraded.items()):
        log(f"bundling {name} {r.bundle[name]['version']} although the target has it: {why}")
    for p in problems:
        log(f"warning: {p}")
    manifest = {
        "python": args.python,
        "platform": args.platform,
        "have": args.have or "default list (scripts/offline_bundle.py DEFAULT_HAVE)",
        "wheels": {
            n: {**r.bundle[n], "required_by": sorted({p for _, p in r.edges.get(n, {})})}
            for n in sorted(r.bundle)
        },
        "skipped": dict(sorted(r.skipped.items())),
        "bundled_over_target": dict(sorted(r.upgraded.items())),
        "unmet_requirements": problems,
    }
    Path(args.manifest).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"{len(r.bundle)} wheels, {len(r.skipped)} distributions left to the target")


def retag(args: argparse.Namespace) -> None:
    """vLLM's setup.py tags even its device-less build for the building
    interpreter (cp311-cp311-linux_x86_64) although it holds no compiled
    code: make it what it is, py3-none-any, and print the new file's path."""
    whl = Path(args.wheel)
    dist, version = whl.name.split("-")[:2]
    new = whl.with_name(f"{dist}-{version}-py3-none-any.whl")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(whl) as zin:
        compiled = [n for n in zin.namelist() if n.endswith((".so", ".pyd", ".dylib"))]
        if compiled:
            sys.exit(f"bundle: {whl.name} holds compiled code ({compiled[0]}, ...): cannot retag it")
        wheel_meta = zin.read(f"{info}/WHEEL").decode()
        wheel_meta = re.sub(r"(?m)^Root-Is-Purelib: .*$", "Root-Is-Purelib: true", wheel_meta)
        wheel_meta = re.sub(r"(?m)^Tag: .*\n", "", wheel_meta)
        wheel_meta = wheel_meta.rstrip("\n") + "\nTag: py3-none-any\n\n"
        digest = base64.urlsafe_b64encode(hashlib.sha256(wheel_meta.encode()).digest()).rstrip(b"=")
        record = [
            f"{info}/WHEEL,sha256={digest.decode()},{len(wheel_meta.encode())}"
            if line.startswith(f"{info}/WHEEL,") else line
            for line in zin.read(f"{info}/RECORD").decode().splitlines()
        ]
        with zipfile.ZipFile(new, "w", zipfile.ZIP_DEFLATED) as zout:
            for item in zin.infolist():
                if item.filename == f"{info}/WHEEL":
                    zout.writestr(item, wheel_meta)
                elif item.filename == f"{info}/RECORD":
                    zout.writestr(item, "\n".join(record) + "\n")
                else:
                    zout.writestr(item, zin.read(item))
    if new != whl:
        whl.unlink()
    print(new)


def repack(args: argparse.Namespace) -> None:
    for whl in map(Path, args.wheels):
        tmp = whl.with_suffix(".tmp")
        with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = zin.read(info)
                info.compress_type = zipfile.ZIP_STORED
                zout.writestr(info, data)
        os.replace(tmp, whl)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("resolve")
    p.add_argument("--python", required=True)
    p.add_argument("--platform", required=True)
    p.add_argument("--have")
    p.add_argument("--full", action="store_true", help="keep NOT_AT_RUNTIME too")
    p.add_argument("--wheels", required=True, help="download directory")
    p.add_argument("--manifest", required=True)
    p.add_argument("local", nargs="+", help="wheels built here (vLLM, vllm-accel)")
    p = sub.add_parser("retag")
    p.add_argument("wheel")
    p = sub.add_parser("repack")
    p.add_argument("wheels", nargs="+")
    args = ap.parse_args()
    {"resolve": resolve, "retag": retag, "repack": repack}[args.cmd](args)


if __name__ == "__main__":
    main()
