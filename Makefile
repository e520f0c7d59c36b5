# The README's two commands: `make demo` and `make test`. Both (re)create the virtual
# environment when pyproject.toml or this Makefile changed, then run the main job / the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FRAMEWORKS ?= torch,tensorflow,jax
export POLYAMP_TEST_FRAMEWORKS ?= $(FRAMEWORKS)

.PHONY: demo test venv lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel; any other version pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[fast,torch,tensorflow,jax,dev,bench,compare]"
	touch $(STAMP)

# The main job: every installed framework, workload and policy side by side (about 3 minutes here).
demo: venv
	$(PY) -m polyamp cast 68.00000356923152 --to fp16,bf16,e4m3fn,e5m2,e2m1fn
	$(PY) -m polyamp compare --out compare-report

test: venv
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m pytest -q

bench: venv
	$(PY) benchmarks/quantize.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
