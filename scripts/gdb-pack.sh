#!/usr/bin/env bash
# Bundle this machine's gdb for the GPU machine (which has none), to read the
# thread stacks of a hung test there. Writes .gdb-carry/gdb.tar.zst (~27 MB) and
# .gdb-carry/zstd: gdb, the shared libraries it needs except glibc's own, its
# data directory, and a zipped Python standard library (gdb embeds Python and
# will not start without one). The fifth session found the device-side fill
# waits' deadlock this way (docs/RESIDENCY.md, "Why the host waits").
#
# There (carry .gdb-carry; .carry may not fit beside it, so carry the test
# binaries you need in a folder of their own):
#   .gdb-carry/zstd -dc .gdb-carry/gdb.tar.zst | tar -C /tmp -xf -
#   G=/tmp/gdbk; PYTHONHOME=$G/ph LD_LIBRARY_PATH=$G/lib $G/gdb -nx --data-directory=$G/share/gdb \
#     -batch -p PID -ex 'thread apply all bt 30'
# (PID of the test binary itself, not of a `timeout` wrapping it.)
set -euo pipefail
cd "$(dirname "$0")/.."
GDB=$(command -v gdb) || { echo "error: no gdb here" >&2; exit 2; }
PYV=$(ldd "$GDB" | sed -n 's/.*libpython\([0-9.]*[0-9]\)\.so.*/\1/p' | head -1)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
mkdir -p "$W/gdbk/lib" "$W/gdbk/share" "$W/gdbk/ph/lib/python$PYV/lib-dynload" .gdb-carry
cp "$GDB" "$W/gdbk/"
ldd "$GDB" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt)\.so|ld-linux' |
  xargs -I{} cp -L {} "$W/gdbk/lib/"
cp -r /usr/share/gdb "$W/gdbk/share/gdb"
if [ -n "$PYV" ]; then
  (cd "/usr/lib/python$PYV" && zip -qr "$W/gdbk/ph/lib/python${PYV/./}.zip" . \
    -x 'test/*' 'site-packages/*' 'dist-packages/*' '*__pycache__*' 'idlelib/*' 'tkinter/*' 'lib2to3/*' \
       'ensurepip/*' 'distutils/*' 'unittest/*' 'pydoc_data/*' 'config-*' 'lib-dynload/*')
fi
tar -C "$W" -cf - gdbk | zstd -19 -T0 -q -f -o .gdb-carry/gdb.tar.zst
cp "$(command -v zstd)" .gdb-carry/zstd
ls -la .gdb-carry
