# epmem: build, install, test, demo.
#
#   make build                 cargo build --release (libepmem.so, libepmem.a)
#   make install PREFIX=/opt   lib/libepmem.so.X.Y.Z (+ .so.X, .so links), lib/libepmem.a,
#                              include/epmem.h, lib/pkgconfig/epmem.pc, lib/cmake/epmem/
#   make uninstall PREFIX=/opt what install put there
#   make test                  everything CI runs (the README's test command)
#   make demo                  build and run the demo against an installed copy
#
# The C tests link the testing variant of the library (--features testing:
# EPM_FAULT, the spin/checksum kernels and panic hooks of
# include/epmem_testing.h), built into its own target dir and named
# libepmem_testing.so so it never shadows the shipped libepmem.so on a
# library path. They find it through an rpath relative to the binary, so
# target/ffi-tests/ and target/testing/release/ can be shipped together to a
# GPU machine (see scripts/gpu-pack.sh, scripts/gpu-check.sh). `make install`
# ships the default build only, and only include/epmem.h.
# Programs linked against libepmem.so record its SONAME, libepmem.so.0:
# build.rs puts that link beside it in the build tree.

PREFIX   ?= /usr/local
CC       ?= cc
CARGO    ?= cargo
VERSION  := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
# SONAME libepmem.so.$(MAJOR): every 0.x is ABI-compatible with the one before
# (build.rs says why); the real file carries the full version.
MAJOR    := $(word 1,$(subst ., ,$(VERSION)))
SONAME   := libepmem.so.$(MAJOR)
REALNAME := libepmem.so.$(VERSION)
LIBDIR   ?= $(PREFIX)/lib
INCDIR   ?= $(PREFIX)/include

WARN      := -Wall -Wextra -Werror
TEST_CFLAGS ?= -std=c11 $(WARN) -O1 -g -fno-omit-frame-pointer -pthread
LIB_DIR   := target/release
TESTING_LIB_DIR := target/testing/release
TESTING_LIB := $(TESTING_LIB_DIR)/libepmem_testing.so
TEST_DIR  := target/ffi-tests
TEST_SRCS := $(wildcard ffi-tests/test_*.c)
TEST_BINS := $(patsubst ffi-tests/%.c,$(TEST_DIR)/%,$(TEST_SRCS))
# The same tests under AddressSanitizer (with leak checks) and UBSan, run in
# CI only: the plain binaries are the ones shipped to the GPU machine.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined
SAN_BINS  := $(patsubst ffi-tests/%.c,$(TEST_DIR)/san/%,$(TEST_SRCS))
EXAMPLES  := $(wildcard examples-c/*.c)
# scripts/gpu-check.sh compiles the C tests and examples with -O2 -Werror on the
# GPU machine; some warnings (-Warray-bounds) need the optimizer, so the same
# compile runs here (objects only) and a warning fails `make test-c` first.
O2_OBJS   := $(patsubst %.c,$(TEST_DIR)/o2/%.o,$(TEST_SRCS) $(EXAMPLES))
# What an example may use besides epmem: threads and libm.
EX_LIBS   := -pthread -lm
# The demo is examples-c/offload_decode.c once it exists; until then the
# device tour stands in, so `make demo` always shows something real.
DEMO      := $(if $(wildcard examples-c/offload_decode.c),offload_decode,device_info)

.PHONY: build build-testing install uninstall wheel test-python test test-rust test-c test-valgrind test-long test-examples test-ort ffi-tests demo clean-c lint

build:
	$(CARGO) build --release

# The second variant (~30 s more in CI): same sources, --features testing.
build-testing:
	CARGO_TARGET_DIR=target/testing $(CARGO) build --release --lib --features testing
	cp $(TESTING_LIB_DIR)/libepmem.so $(TESTING_LIB)


# The .pc file's Libs carry -Wl,-rpath,<libdir> only when <libdir> is not a
# directory the loader searches (ldconfig's list): then the README's build
# line, `cc app.c $(pkg-config --cflags --libs epmem)`, gives a program that
# starts with no LD_LIBRARY_PATH from any prefix, while a system prefix
# (/usr/local, /usr) gets no rpath and is found through ldconfig's cache,
# which install refreshes when it may (root, no DESTDIR) or says how to.
LOADER_DIRS = $$(ldconfig -N -v 2>/dev/null | sed -n 's|^\(/[^:]*\):.*|\1|p' | xargs -r realpath -m 2>/dev/null)
# `make build && sudo make install`: root's PATH often has no cargo, so
# install rebuilds only where cargo is found and otherwise installs what is built.
HAVE_CARGO := $(shell command -v $(CARGO) 2>/dev/null)
install: $(if $(HAVE_CARGO),build)
	@[ -f $(LIB_DIR)/libepmem.so ] && [ -f $(LIB_DIR)/libepmem.a ] || \
	  { echo "install: no $(LIB_DIR)/libepmem.so or libepmem.a: run make build first"; exit 1; }
	install -d $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(LIBDIR)/cmake/epmem $(DESTDIR)$(INCDIR)
	install -m 755 $(LIB_DIR)/libepmem.so $(DESTDIR)$(LIBDIR)/$(REALNAME)
	ln -sfn $(REALNAME) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sfn $(SONAME) $(DESTDIR)$(LIBDIR)/libepmem.so
	install -m 644 $(LIB_DIR)/libepmem.a $(DESTDIR)$(LIBDIR)/libepmem.a
	install -m 644 include/epmem.h $(DESTDIR)$(INCDIR)/epmem.h
	@libdir=$$(realpath -m $(LIBDIR)); system=0; \
	for d in $(LOADER_DIRS); do [ "$$d" = "$$libdir" ] && system=1; done; \
	if [ $$system = 1 ]; then rpath=""; else rpath=' -Wl,-rpath,$${libdir}'; fi; \
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCDIR@|$(INCDIR)|g' \
	    -e 's|@VERSION@|$(VERSION)|g' -e "s|@RPATH@|$$rpath|g" epmem.pc.in \
	  > $(DESTDIR)$(LIBDIR)/pkgconfig/epmem.pc; \
	for f in epmemConfig.cmake epmemConfigVersion.cmake; do \
	  sed -e 's|@VERSION@|$(VERSION)|g' -e 's|@MAJOR@|$(MAJOR)|g' -e 's|@SONAME@|$(SONAME)|g' \
	      -e 's|@REALNAME@|$(REALNAME)|g' cmake/$$f.in > $(DESTDIR)$(LIBDIR)/cmake/epmem/$$f; \
	done; \
	if [ $$system = 0 ]; then \
	  echo "install: $(LIBDIR) is not on the loader's path; programs built with pkg-config or CMake carry an rpath to it"; \
	elif [ -n "$(DESTDIR)" ]; then \
	  echo "install: staged under DESTDIR; run ldconfig once the files are in $(LIBDIR)"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  ldconfig; if ldconfig -p | grep -q "=> $$libdir/$(SONAME)\$$"; then \
	    echo "install: ran ldconfig: the loader finds $(SONAME) in $(LIBDIR)"; \
	  else echo "install: ran ldconfig, but its cache has no $$libdir/$(SONAME): check /etc/ld.so.conf"; fi; \
	else \
	  echo "install: run 'sudo ldconfig' so the loader finds $(SONAME) in $(LIBDIR)"; \
	fi

uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/$(REALNAME) $(DESTDIR)$(LIBDIR)/$(SONAME) $(DESTDIR)$(LIBDIR)/libepmem.so \
	  $(DESTDIR)$(LIBDIR)/libepmem.a $(DESTDIR)$(INCDIR)/epmem.h $(DESTDIR)$(LIBDIR)/pkgconfig/epmem.pc \
	  $(DESTDIR)$(LIBDIR)/cmake/epmem/epmemConfig.cmake $(DESTDIR)$(LIBDIR)/cmake/epmem/epmemConfigVersion.cmake
	@rmdir $(DESTDIR)$(LIBDIR)/cmake/epmem 2>/dev/null || true
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && ldconfig -p | grep -q '$(LIBDIR)/$(SONAME)'; then ldconfig; fi

# ---- C tests ---------------------------------------------------------------

TEST_DEPS := ffi-tests/testhelper.h ffi-tests/misuse.h $(wildcard ffi-tests/abi/*.h) include/epmem.h include/epmem_testing.h $(TESTING_LIB)

$(TEST_DIR)/%: ffi-tests/%.c $(TEST_DEPS)
	@mkdir -p $(TEST_DIR)
	$(CC) $(TEST_CFLAGS) -Iinclude -o $@ $< -L$(TESTING_LIB_DIR) -lepmem_testing -Wl,-rpath,'$$ORIGIN/../testing/release'

$(TEST_DIR)/san/%: ffi-tests/%.c $(TEST_DEPS)
	@mkdir -p $(TEST_DIR)/san
	$(CC) $(TEST_CFLAGS) $(SAN_FLAGS) -Iinclude -o $@ $< -L$(TESTING_LIB_DIR) -lepmem_testing -Wl,-rpath,'$$ORIGIN/../../testing/release'

$(TEST_DIR)/o2/%.o: %.c $(TEST_DEPS)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 $(WARN) -O2 -g -Iinclude -c -o $@ $<

$(LIB_DIR)/libepmem.so: build
$(TESTING_LIB): build-testing

ffi-tests: build build-testing $(TEST_BINS)

# ---- the test command --------------------------------------------------------

# The CPU micro-benchmarks (tools/benches/micro.rs) are compiled, not timed: timings
# on a shared CI machine mean nothing. Run them with `cargo bench -p epmem-tools --bench micro`.
# --workspace: the benches, their smoke tests and kv_churn are the tools/ crate's.
test-rust:
	$(CARGO) test --workspace
	$(CARGO) bench --workspace --no-run

# The lints Cargo.toml's [lints.clippy] declares (every unsafe block has a
# `// SAFETY:` comment on the line above), over every target; clippy's
# default lint groups are off here: only the declared rules fail the build.
lint:
	@$(CARGO) clippy --version >/dev/null 2>&1 || { echo "make lint: cargo clippy is missing (rustup component add clippy)" >&2; exit 1; }
	$(CARGO) clippy --workspace --all-targets --features testing -- -A clippy::all
	@$(CARGO) fmt --version >/dev/null 2>&1 || { echo "make lint: cargo fmt is missing (rustup component add rustfmt)" >&2; exit 1; }
	$(CARGO) fmt --all --check

# The C tests run three ways: plain and sanitized on the host device, then
# plain with EPM_DEVICE=cuda against the fake libcuda the CUDA device's own
# tests use (src/device/cuda/fake_libcuda.c), so the CUDA code path behind
# every epm_* function is exercised without a GPU.
FAKE_CUDA_SRC := $(wildcard src/device/cuda/fake_libcuda.c)
FAKE_CUDA_DIR := target/fake-cuda

$(FAKE_CUDA_DIR)/libcuda.so: $(FAKE_CUDA_SRC)
	@mkdir -p $(FAKE_CUDA_DIR)
	$(CC) -shared -fPIC -O1 -o $@ $<

test-c: $(O2_OBJS) ffi-tests $(SAN_BINS) $(if $(FAKE_CUDA_SRC),$(FAKE_CUDA_DIR)/libcuda.so)
	@fail=0; for t in $(TEST_BINS) $(SAN_BINS); do \
	  echo "== $$t"; $$t || { echo "FAILED: $$t (exit $$?)"; fail=1; }; \
	done; \
	if [ -n "$(FAKE_CUDA_SRC)" ]; then for t in $(TEST_BINS); do \
	  echo "== $$t (EPM_DEVICE=cuda, fake libcuda)"; \
	  LD_LIBRARY_PATH=$(FAKE_CUDA_DIR) EPM_DEVICE=cuda $$t || { echo "FAILED: $$t on fake cuda (exit $$?)"; fail=1; }; \
	done; fi; exit $$fail

# The misuse suite (and the error tests) under valgrind memcheck: invalid
# reads/writes or a definite leak fail the run (ASan above covers the same
# binaries built with -fsanitize; valgrind also sees inside libepmem.so).
# About 10 s on a 2-core machine. Without valgrind the target fails before
# building anything (CI installs it: a missing tool must not read as a pass);
# tests/makefile.rs checks that with VALGRIND_BIN pointing nowhere.
VALGRIND_TESTS := $(filter $(TEST_DIR)/test_misuse% $(TEST_DIR)/test_errors,$(TEST_BINS))
VALGRIND_BIN ?= valgrind
VALGRIND := $(VALGRIND_BIN) -q --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite

.PHONY: valgrind-present
valgrind-present:
	@command -v $(VALGRIND_BIN) >/dev/null 2>&1 || \
	  { echo "test-valgrind: $(VALGRIND_BIN) not found: install valgrind (CI does; .ci/run checks for it)" >&2; exit 1; }

test-valgrind: valgrind-present ffi-tests
	@fail=0; for t in $(VALGRIND_TESTS); do \
	  echo "== valgrind $$t"; $(VALGRIND) $$t >/dev/null || { echo "FAILED under valgrind: $$t (exit $$?)"; fail=1; }; \
	done; exit $$fail

# The long runs of scripts/long-run.sh, shortened (--quick: seconds on the
# host device); the H200 runs the full length with EPM_DEVICE=cuda.
test-long: build
	@scripts/long-run.sh --quick > target/long-run.log 2>&1 || { cat target/long-run.log; exit 1; }; \
	sed -n '/^== long-run verdicts/,$$p' target/long-run.log

# Install, then build every example exactly as the README says,
# `cc app.c $(pkg-config --cflags --libs epmem)` (warnings as errors added),
# with nothing from this tree, and run it with no LD_LIBRARY_PATH; then the
# CMake example (examples-cmake/, find_package(epmem)), shared and static.
# By default into a throw-away prefix, which the .pc file's rpath serves;
# EXAMPLE_PREFIX=/usr/local (.ci/run, as root on a fresh machine) tests the
# README's default install with ldconfig, and uninstalls afterwards.
# readelf checks the SONAME, the links, and that each program records it.
EXAMPLE_PREFIX ?=
test-examples: build
	@set -e; work=$$(mktemp -d); \
	if [ -n "$(EXAMPLE_PREFIX)" ]; then prefix=$(EXAMPLE_PREFIX); \
	  trap '$(MAKE) --no-print-directory uninstall PREFIX=$(EXAMPLE_PREFIX) >/dev/null; rm -rf "$$work"' EXIT; \
	else prefix=$$work/prefix; trap 'rm -rf "$$work"' EXIT; fi; \
	$(MAKE) --no-print-directory install PREFIX=$$prefix >$$work/install.log 2>&1 || { cat $$work/install.log; exit 1; }; \
	grep '^install:' $$work/install.log || true; \
	lib=$$prefix/lib; \
	soname=$$(readelf -d $$lib/$(REALNAME) | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'); \
	[ "$$soname" = "$(SONAME)" ] || { echo "SONAME of $(REALNAME) is '$$soname', not $(SONAME)"; exit 1; }; \
	[ "$$(readlink $$lib/$(SONAME))" = "$(REALNAME)" ] && [ "$$(readlink $$lib/libepmem.so)" = "$(SONAME)" ] || \
	  { echo "expected libepmem.so -> $(SONAME) -> $(REALNAME) in $$lib:"; ls -l $$lib; exit 1; }; \
	echo "== $$lib/$(REALNAME): SONAME $$soname, links libepmem.so -> $(SONAME) -> $(REALNAME)"; \
	pcpath=""; [ "$$prefix" = /usr/local ] || pcpath="PKG_CONFIG_PATH=$$lib/pkgconfig"; \
	for ex in $(EXAMPLES); do \
	  name=$$(basename $$ex .c); \
	  echo "== example $$name: $${pcpath:+$$pcpath }cc $$name.c \$$(pkg-config --cflags --libs epmem) -> $$(env $$pcpath pkg-config --cflags --libs epmem)"; \
	  cp $$ex $$work/$$name.c; \
	  (cd $$work && env $$pcpath $(CC) $(WARN) $$name.c $$(env $$pcpath pkg-config --cflags --libs epmem) -o $$name); \
	  readelf -d $$work/$$name | grep -q "(NEEDED).*\[$(SONAME)\]" || \
	    { echo "$$name does not record NEEDED $(SONAME):"; readelf -d $$work/$$name | grep NEEDED; exit 1; }; \
	  env -u LD_LIBRARY_PATH $$work/$$name; \
	done; \
	echo "== README.md's C program (its first C block): cc app.c \$$(pkg-config --cflags --libs epmem)"; \
	awk '/^```c$$/ {p = 1; next} p && /^```$$/ {exit} p' README.md > $$work/app.c; \
	grep -q 'int main' $$work/app.c || { echo "README.md's first C block is not a program (no main)"; exit 1; }; \
	(cd $$work && env $$pcpath $(CC) $(WARN) app.c $$(env $$pcpath pkg-config --cflags --libs epmem) -o app); \
	env -u LD_LIBRARY_PATH $$work/app; \
	echo "== the installed library has no test machinery"; \
	if nm -D --defined-only $$prefix/lib/libepmem.so | grep -E ' (epm_device_spin_async|epm_device_checksum_async|epm_checksum_host|epm_testing_[a-z_]*)$$'; then \
	  echo "libepmem.so exports test machinery"; exit 1; fi; \
	if [ -e $$prefix/include/epmem_testing.h ]; then echo "epmem_testing.h was installed"; exit 1; fi; \
	EPM_FAULT=warp:1 $$work/device_info >/dev/null 2>&1 || { echo "the installed library honoured EPM_FAULT"; exit 1; }; \
	echo "== example device_info, linked statically (libepmem.a + Libs.private)"; \
	$(CC) -std=c11 $(WARN) -o $$work/device_info_static examples-c/device_info.c \
	  $$(env $$pcpath pkg-config --cflags epmem) \
	  -L$$lib -Wl,-Bstatic -lepmem -Wl,-Bdynamic \
	  $$(env $$pcpath pkg-config --static --libs-only-l epmem | sed 's/-lepmem//'); \
	if readelf -d $$work/device_info_static | grep -q libepmem; then \
	  echo "device_info_static needs libepmem.so: the static library was not used"; exit 1; fi; \
	$$work/device_info_static >/dev/null; \
	if ! command -v cmake >/dev/null 2>&1; then \
	  echo "test-examples: cmake not installed, CMake example skipped (.ci/run installs it)"; exit 0; fi; \
	cmpath=""; [ "$$prefix" = /usr/local ] || cmpath="-DCMAKE_PREFIX_PATH=$$prefix"; \
	for kind in shared static; do \
	  b=$$work/cmake-$$kind; st=OFF; [ $$kind = shared ] || st=ON; \
	  echo "== CMake example (examples-cmake/), $$kind: cmake -S examples-cmake -B build $$cmpath -DEPMEM_HELLO_STATIC=$$st"; \
	  { cmake -S examples-cmake -B $$b $$cmpath -DEPMEM_HELLO_STATIC=$$st && cmake --build $$b; } >$$b.log 2>&1 || \
	    { cat $$b.log; exit 1; }; \
	  grep -- '-- epmem ' $$b.log; \
	  if [ $$kind = shared ]; then readelf -d $$b/epmem_hello | grep -q "(NEEDED).*\[$(SONAME)\]" || \
	    { echo "epmem_hello does not record NEEDED $(SONAME)"; exit 1; }; \
	  elif readelf -d $$b/epmem_hello | grep -q libepmem; then echo "static epmem_hello needs libepmem.so"; exit 1; fi; \
	  env -u LD_LIBRARY_PATH $$b/epmem_hello; \
	done; \
	cmake -S examples-cmake -B $$work/cmake-var $$cmpath -Depmem_USE_STATIC=ON 2>&1 | grep -q -- '-- epmem $(VERSION) (static)' || \
	  { echo "epmem_USE_STATIC=ON did not make epmem::epmem the static library"; exit 1; }; \
	echo "== epmem_USE_STATIC=ON selects the static library too"; \
	if cmake -S examples-cmake -B $$work/cmake-v1 $$cmpath -DEPMEM_HELLO_REQUIRE=1.0 >$$work/cmake-v1.log 2>&1 || \
	   ! grep -q 'version: $(VERSION)' $$work/cmake-v1.log; then \
	  cat $$work/cmake-v1.log; echo "find_package(epmem 1.0) did not refuse epmem $(VERSION) for its version"; exit 1; fi; \
	echo "== find_package(epmem 1.0) refuses $(VERSION), as it must"

test:
	$(MAKE) test-rust
	$(MAKE) lint
	$(MAKE) test-c
	$(MAKE) test-valgrind
	$(MAKE) test-long
	$(MAKE) test-examples
	$(MAKE) test-ort
	$(MAKE) test-python
	@echo "make test: all suites passed"

# The ONNX Runtime plugin EP against real onnxruntime wheels from PyPI (a venv
# per version under .venv/); the GPU machine runs the same tests with
# scripts/ort-test.sh --no-install.
test-ort: build
	scripts/ort-test.sh

# The Python package (python/epmem) as a wheel bundling libepmem.so, and its
# tests (binding, epmem.torch) against that wheel installed, with torch from
# PyPI in .venv/torch (installed once, ~2-3 min; docs/PYTHON.md).
wheel:
	python3 -m pip wheel --no-deps -w target/wheels .

test-python: build
	scripts/python-test.sh

# ---- demo --------------------------------------------------------------------

demo: build
	@set -e; prefix=$$(mktemp -d); trap 'rm -rf "$$prefix"' EXIT; \
	$(MAKE) --no-print-directory install PREFIX=$$prefix >/dev/null; \
	PKG_CONFIG_PATH=$$prefix/lib/pkgconfig $(CC) -std=c11 $(WARN) -O2 -o $$prefix/$(DEMO) examples-c/$(DEMO).c \
	  $$(PKG_CONFIG_PATH=$$prefix/lib/pkgconfig pkg-config --cflags --libs epmem) $(EX_LIBS); \
	$$prefix/$(DEMO)

clean-c:
	rm -rf $(TEST_DIR)
