# Both targets build .venv from scratch when it is missing. torch is installed first and pinned
# to 2.13.0 (the CPU wheel on this kind of machine), so no CUDA build is ever pulled.
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: demo test setup clean bench-gpu

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps verl==0.9.1  # RL losses' reference; its imports: the dev extra
	touch $@

setup: .venv/.installed

demo: setup
	.venv/bin/fullshard train

# two pytest workers (pytest-xdist), each file on one worker (its module fixtures built once), the
# slowest files first (tests/conftest.py's order, kept by --no-loadscope-reorder); the summary ends
# with the slowest 25 tests and the suite's total wall and CPU time (tests/conftest.py)
test: setup
	.venv/bin/ruff check src tests bench && $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

clean:
	rm -rf .venv runs out

# On a GPU machine whose Python already has torch (CUDA): install fullshard into it (and torchtitan, pinned to
# that torch, for the peer), write the GPU section of BENCHMARKS.md (NCCL, bf16, the memory plan against
# the allocator's peak), then run the suite's GPU tests. `python bench/gpu.py --dry-run` checks it on CPU.
bench-gpu:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	python3 bench/gpu.py --json bench-gpu.json
	python3 bench/gpu_checks.py
	python3 -m pytest -q -rs tests/test_strategy.py -k gpu
