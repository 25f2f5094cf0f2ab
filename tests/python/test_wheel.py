"""The installed wheel's platform tag is honest, as auditwheel would check it: the
tag is py3-none-manylinux_2_N_<arch> with N the newest GLIBC_2.N symbol version
epmem/lib/libepmem.so needs (read here with readelf, independently of the build's
objdump), the library links only what every manylinux system has, and it is the
wheel that pip installed (RECORD). Runs on the wheel scripts/python-test.sh
installs (EPMEM_USE_INSTALLED=1); from a source tree there is no wheel to check."""

import os
import platform
import re
import shutil
import subprocess
import unittest
from importlib import metadata

import epmem

# What manylinux (PEP 600) lets a wheel's libraries link against from the system.
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def readelf(*args):
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


@unittest.skipUnless(os.environ.get("EPMEM_USE_INSTALLED") == "1",
                     "checks the installed wheel: scripts/python-test.sh installs one (EPMEM_USE_INSTALLED=1)")
@unittest.skipIf(shutil.which("readelf") is None, "readelf (binutils) is not installed")
class WheelTag(unittest.TestCase):
    def setUp(self):
        self.dist = metadata.distribution("epmem")
        self.lib = os.path.join(os.path.dirname(os.path.abspath(epmem.__file__)), "lib", "libepmem.so")

    def tags(self):
        return [line.split(": ", 1)[1] for line in self.dist.read_text("WHEEL").splitlines()
                if line.startswith("Tag: ")]

    def test_tag_matches_the_glibc_symbol_versions(self):
        tags = self.tags()
        self.assertEqual(len(tags), 1, tags)
        m = re.fullmatch(r"py3-none-manylinux_2_(\d+)_(\w+)", tags[0])
        self.assertIsNotNone(m, f"not a py3-none-manylinux_2_N tag: {tags[0]}")
        self.assertEqual(m.group(2), platform.machine())
        needed = [int(v) for v in re.findall(r"Name: GLIBC_2\.(\d+)", readelf("--version-info", "-W", self.lib))]
        self.assertTrue(needed, "readelf found no GLIBC version the library needs")
        self.assertEqual(int(m.group(1)), max(needed + [17]),
                         f"the tag claims glibc 2.{m.group(1)}; the library needs 2.{max(needed)}")
        # And it loads here, so this machine's glibc is at least that.
        self.assertGreaterEqual(int(platform.libc_ver()[1].split(".")[1]), int(m.group(1)))

    def test_library_links_only_what_manylinux_allows(self):
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", "-W", self.lib))
        self.assertIn("libc.so.6", needed)
        self.assertEqual(set(needed) - MANYLINUX_LIBS, set(), f"NEEDED {needed}")
        # Versioned references to other libraries than glibc and libgcc_s would need them too.
        files = set(re.findall(r"File: (\S+)", readelf("--version-info", "-W", self.lib)))
        self.assertEqual(files - MANYLINUX_LIBS, set(), files)

    def test_the_library_is_the_wheel_s(self):
        rec = {str(f): f for f in self.dist.files or []}
        self.assertIn("epmem/lib/libepmem.so", rec)
        self.assertIn("epmem/include/epmem.h", rec)
        self.assertEqual(os.path.realpath(str(rec["epmem/lib/libepmem.so"].locate())), os.path.realpath(self.lib))
        self.assertEqual(epmem.get_library_path(), self.lib)


if __name__ == "__main__":
    unittest.main()
