# epmem: build, install, test, demo.
#
#   make build                 cargo build --release (libepmem.so, libepmem.a)
#   make install PREFIX=/opt   lib/libepmem.{so,a}, include/epmem.h, lib/pkgconfig/epmem.pc
#   make test                  everything CI runs (the README's test command)
#   make demo                  build and run the demo against an installed copy
#
# The C tests link target/release/libepmem.so with an rpath relative to the
# binary, so target/ffi-tests/ and target/release/ can be shipped together to
# a GPU machine and run there with EPM_DEVICE=cuda (see scripts/gpu-check.sh).

PREFIX   ?= /usr/local
CC       ?= cc
CARGO    ?= cargo
VERSION  := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)

WARN      := -Wall -Wextra -Werror
TEST_CFLAGS ?= -std=c11 $(WARN) -O1 -g -fno-omit-frame-pointer -pthread
LIB_DIR   := target/release
TEST_DIR  := target/ffi-tests
TEST_SRCS := $(wildcard ffi-tests/test_*.c)
TEST_BINS := $(patsubst ffi-tests/%.c,$(TEST_DIR)/%,$(TEST_SRCS))
# The same tests under AddressSanitizer (with leak checks) and UBSan, run in
# CI only: the plain binaries are the ones shipped to the GPU machine.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined
SAN_BINS  := $(patsubst ffi-tests/%.c,$(TEST_DIR)/san/%,$(TEST_SRCS))
EXAMPLES  := $(wildcard examples-c/*.c)
# What an example may use besides epmem: threads and libm.
EX_LIBS   := -pthread -lm
# The demo is examples-c/offload_decode.c once it exists; until then the
# device tour stands in, so `make demo` always shows something real.
DEMO      := $(if $(wildcard examples-c/offload_decode.c),offload_decode,device_info)

.PHONY: build install uninstall wheel test-python test test-rust test-c test-valgrind test-long test-examples test-ort ffi-tests demo clean-c

build:
	$(CARGO) build --release

install: build
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include
	install -m 755 $(LIB_DIR)/libepmem.so $(DESTDIR)$(PREFIX)/lib/libepmem.so
	install -m 644 $(LIB_DIR)/libepmem.a $(DESTDIR)$(PREFIX)/lib/libepmem.a
	install -m 644 include/epmem.h $(DESTDIR)$(PREFIX)/include/epmem.h
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' epmem.pc.in \
	  > $(DESTDIR)$(PREFIX)/lib/pkgconfig/epmem.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/lib/libepmem.so $(DESTDIR)$(PREFIX)/lib/libepmem.a \
	  $(DESTDIR)$(PREFIX)/include/epmem.h $(DESTDIR)$(PREFIX)/lib/pkgconfig/epmem.pc

# ---- C tests ---------------------------------------------------------------

$(TEST_DIR)/%: ffi-tests/%.c ffi-tests/testhelper.h ffi-tests/misuse.h include/epmem.h $(LIB_DIR)/libepmem.so
	@mkdir -p $(TEST_DIR)
	$(CC) $(TEST_CFLAGS) -Iinclude -o $@ $< -L$(LIB_DIR) -lepmem -Wl,-rpath,'$$ORIGIN/../release'

$(TEST_DIR)/san/%: ffi-tests/%.c ffi-tests/testhelper.h ffi-tests/misuse.h include/epmem.h $(LIB_DIR)/libepmem.so
	@mkdir -p $(TEST_DIR)/san
	$(CC) $(TEST_CFLAGS) $(SAN_FLAGS) -Iinclude -o $@ $< -L$(LIB_DIR) -lepmem -Wl,-rpath,'$$ORIGIN/../../release'

$(LIB_DIR)/libepmem.so: build

ffi-tests: build $(TEST_BINS)

# ---- the test command --------------------------------------------------------

# The CPU micro-benchmarks (benches/micro.rs) are compiled, not timed: timings
# on a shared CI machine mean nothing. Run them with `cargo bench --bench micro`.
test-rust:
	$(CARGO) test
	$(CARGO) bench --no-run

# The C tests run three ways: plain and sanitized on the host device, then
# plain with EPM_DEVICE=cuda against the fake libcuda the CUDA device's own
# tests use (src/device/cuda/fake_libcuda.c), so the CUDA code path behind
# every epm_* function is exercised without a GPU.
FAKE_CUDA_SRC := $(wildcard src/device/cuda/fake_libcuda.c)
FAKE_CUDA_DIR := target/fake-cuda

$(FAKE_CUDA_DIR)/libcuda.so: $(FAKE_CUDA_SRC)
	@mkdir -p $(FAKE_CUDA_DIR)
	$(CC) -shared -fPIC -O1 -o $@ $<

test-c: ffi-tests $(SAN_BINS) $(if $(FAKE_CUDA_SRC),$(FAKE_CUDA_DIR)/libcuda.so)
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
# About 10 s on a 2-core machine; skipped with a note when valgrind is missing.
VALGRIND_TESTS := $(filter $(TEST_DIR)/test_misuse% $(TEST_DIR)/test_errors,$(TEST_BINS))
VALGRIND := valgrind -q --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite

test-valgrind: ffi-tests
	@if ! command -v valgrind >/dev/null 2>&1; then echo "test-valgrind: valgrind not installed, skipped"; exit 0; fi; \
	fail=0; for t in $(VALGRIND_TESTS); do \
	  echo "== valgrind $$t"; $(VALGRIND) $$t >/dev/null || { echo "FAILED under valgrind: $$t (exit $$?)"; fail=1; }; \
	done; exit $$fail

# The long runs of scripts/long-run.sh, shortened (--quick: seconds on the
# host device); the H200 runs the full length with EPM_DEVICE=cuda.
test-long: build
	@scripts/long-run.sh --quick > target/long-run.log 2>&1 || { cat target/long-run.log; exit 1; }; \
	sed -n '/^== long-run verdicts/,$$p' target/long-run.log

# Install into a throw-away prefix and build every example the way a user
# would: through pkg-config, nothing from this tree.
test-examples: build
	@set -e; prefix=$$(mktemp -d); trap 'rm -rf "$$prefix"' EXIT; \
	$(MAKE) --no-print-directory install PREFIX=$$prefix >/dev/null; \
	for ex in $(EXAMPLES); do \
	  name=$$(basename $$ex .c); echo "== example $$name"; \
	  PKG_CONFIG_PATH=$$prefix/lib/pkgconfig $(CC) -std=c11 $(WARN) -o $$prefix/$$name $$ex \
	    $$(PKG_CONFIG_PATH=$$prefix/lib/pkgconfig pkg-config --cflags --libs epmem) $(EX_LIBS) -Wl,-rpath,$$prefix/lib; \
	  $$prefix/$$name; \
	done; \
	echo "== example device_info, linked statically (libepmem.a + Libs.private)"; \
	$(CC) -std=c11 $(WARN) -o $$prefix/device_info_static examples-c/device_info.c \
	  $$(PKG_CONFIG_PATH=$$prefix/lib/pkgconfig pkg-config --cflags epmem) \
	  -L$$prefix/lib -Wl,-Bstatic -lepmem -Wl,-Bdynamic \
	  $$(PKG_CONFIG_PATH=$$prefix/lib/pkgconfig pkg-config --static --libs-only-l epmem | sed 's/-lepmem//'); \
	if ldd $$prefix/device_info_static | grep -q libepmem; then \
	  echo "device_info_static links libepmem.so: the static library was not used"; exit 1; fi; \
	$$prefix/device_info_static >/dev/null

test:
	$(MAKE) test-rust
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
wheel: build
	python3 scripts/build_wheel.py --lib $(LIB_DIR)/libepmem.so --out target/wheels

test-python: build
	scripts/python-test.sh

# ---- demo --------------------------------------------------------------------

demo: build
	@set -e; prefix=$$(mktemp -d); trap 'rm -rf "$$prefix"' EXIT; \
	$(MAKE) --no-print-directory install PREFIX=$$prefix >/dev/null; \
	PKG_CONFIG_PATH=$$prefix/lib/pkgconfig $(CC) -std=c11 $(WARN) -O2 -o $$prefix/$(DEMO) examples-c/$(DEMO).c \
	  $$(PKG_CONFIG_PATH=$$prefix/lib/pkgconfig pkg-config --cflags --libs epmem) $(EX_LIBS) -Wl,-rpath,$$prefix/lib; \
	$$prefix/$(DEMO)

clean-c:
	rm -rf $(TEST_DIR)
