# Both targets build .venv from scratch when it is missing. torch is installed first and pinned
# to 2.13.0 (the CPU wheel on this kind of machine), so no CUDA build is ever pulled.
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: demo test setup clean

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: .venv/.installed

demo: setup
	.venv/bin/fullshard train

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf .venv runs out
