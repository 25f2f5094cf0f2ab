"""The build steps pyproject.toml's metadata cannot say (setuptools reads this file).

libepmem.so is built by setuptools-rust (a `cargo rustc --lib --release` of the
root crate, the cdylib kept, `strip -S`) and installed as epmem/lib/libepmem.so:
a plain shared library the package dlopens with ctypes, so its file name is
fixed (no CPython ABI suffix) and the wheel's tag is py3-none (any Python 3)
with the manylinux_2_N platform its GLIBC symbol versions allow.
"""

import os
import platform
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_MODULE = "epmem.lib.libepmem"
LIB_PATH = os.path.join("epmem", "lib", "libepmem.so")


def cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        return re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)


def glibc_minor(lib):
    """The newest GLIBC_2.N the library's dynamic symbols need (at least 17, the
    oldest manylinux_2_N pip knows)."""
    out = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout
    return max([int(m) for m in re.findall(r"\bGLIBC_2\.(\d+)\b", out)] + [17])


class BuildExt(build_ext):
    def get_ext_fullpath(self, ext_name):
        # The library keeps its own name (no CPython ABI suffix): the binding
        # loads epmem/lib/libepmem.so.
        path = super().get_ext_fullpath(ext_name)
        if ext_name == LIB_MODULE:
            path = os.path.join(os.path.dirname(path), "libepmem.so")
        return path


class BuildPy(build_py):
    def run(self):
        super().run()
        inc = os.path.join(self.build_lib, "epmem", "include")
        os.makedirs(inc, exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, "include", "epmem.h"), os.path.join(inc, "epmem.h"))


class BdistWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        lib = os.path.join(self.get_finalized_command("build").build_platlib, LIB_PATH)
        if not os.path.isfile(lib):
            raise RuntimeError(f"setup.py: no {lib} to read the platform tag from")
        return "py3", "none", f"manylinux_2_{glibc_minor(lib)}_{platform.machine()}"


def rust_extensions():
    from setuptools_rust import Binding, RustExtension, Strip

    return [RustExtension(LIB_MODULE, path=os.path.join(ROOT, "Cargo.toml"), binding=Binding.NoBinding,
                          strip=Strip.Debug, py_limited_api=False)]


if sys.platform != "linux":
    raise SystemExit("epmem builds on Linux only (CUDA VMM or the memfd host device)")

setup(
    version=cargo_version(),
    rust_extensions=rust_extensions(),
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy, "bdist_wheel": BdistWheel},
)
