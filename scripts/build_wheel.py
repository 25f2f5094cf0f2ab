#!/usr/bin/env python3
"""Bundle an already built libepmem.so into the epmem wheel, with the stdlib only.

    python3 scripts/build_wheel.py --lib .carry/lib/libepmem.so [--out target/wheels]

The standard build is `pip wheel .` (pyproject.toml, setup.py: setuptools-rust
runs cargo). This is the path for a machine with neither Rust nor PyPI (the GPU
machine: scripts/python-test.sh --no-install); it makes the same files and tag.

The wheel is `epmem-<version>-py3-none-manylinux_2_<N>_x86_64.whl`, where N is
the newest GLIBC symbol version libepmem.so needs (read with objdump when it is
there, else the C library's own version), so pip refuses it on an older glibc
instead of failing at dlopen. The library needs only libc and libgcc_s (and
libcuda at run time, which it dlopens). Prints the wheel's path last.
"""

import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
    return m.group(1)


def glibc_minor(lib):
    try:
        out = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout
        vers = [int(m) for m in re.findall(r"GLIBC_2\.(\d+)", out)]
        if vers:
            return max(max(vers), 17)
    except (OSError, subprocess.CalledProcessError):
        pass
    return int(platform.libc_ver()[1].split(".")[1])


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(ROOT, "target", "release", "libepmem.so"))
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "wheels"))
    ap.add_argument("--no-strip", action="store_true", help="keep the library's debug info")
    a = ap.parse_args()
    if not os.path.isfile(a.lib):
        sys.exit(f"build_wheel: no library at {a.lib} (run `cargo build --release`)")
    version = cargo_version()
    machine = platform.machine()
    tag = f"py3-none-manylinux_2_{glibc_minor(a.lib)}_{machine}"
    name = f"epmem-{version}-{tag}.whl"
    dist = f"epmem-{version}.dist-info"
    os.makedirs(a.out, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "libepmem.so")
        shutil.copyfile(a.lib, lib)
        if not a.no_strip and shutil.which("strip"):
            # Debug info is most of the release build's size.
            subprocess.run(["strip", "--strip-debug", lib], check=True)
        files = []  # (arcname, bytes, executable)
        pkg = os.path.join(ROOT, "python", "epmem")
        for fn in sorted(os.listdir(pkg)):
            if fn.endswith(".py"):
                with open(os.path.join(pkg, fn), "rb") as f:
                    files.append((f"epmem/{fn}", f.read(), False))
        with open(lib, "rb") as f:
            files.append(("epmem/lib/libepmem.so", f.read(), True))
        with open(os.path.join(ROOT, "include", "epmem.h"), "rb") as f:
            files.append(("epmem/include/epmem.h", f.read(), False))
        readme = ("epmem: GPU memory machinery for LLM inference (weight residency, VMM arenas, KV-cache "
                  "prefix sharing). ctypes binding of the C API, epmem.torch for PyTorch weight offload, "
                  "and the ONNX Runtime plugin EP library (epmem.get_library_path()). See docs/PYTHON.md.\n")
        meta = (f"Metadata-Version: 2.1\nName: epmem\nVersion: {version}\n"
                "Summary: GPU memory machinery for LLM inference: weight residency, VMM arenas, KV prefix sharing\n"
                "Requires-Python: >=3.9\nProvides-Extra: torch\nRequires-Dist: torch>=2.1; extra == \"torch\"\n"
                f"Description-Content-Type: text/plain\n\n{readme}")
        wheel = f"Wheel-Version: 1.0\nGenerator: epmem scripts/build_wheel.py\nRoot-Is-Purelib: false\nTag: {tag}\n"
        files += [(f"{dist}/METADATA", meta.encode(), False), (f"{dist}/WHEEL", wheel.encode(), False),
                  (f"{dist}/top_level.txt", b"epmem\n", False)]
        record = [record_line(n, d) for n, d, _ in files] + [f"{dist}/RECORD,,"]
        files.append((f"{dist}/RECORD", ("\n".join(record) + "\n").encode(), False))

        path = os.path.join(a.out, name)
        with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
            for arcname, data, exe in files:
                info = zipfile.ZipInfo(arcname, date_time=(2026, 1, 1, 0, 0, 0))
                info.external_attr = ((0o755 if exe else 0o644) | 0o100000) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, data)
        os.replace(path + ".tmp", path)
    print(path)


if __name__ == "__main__":
    main()
