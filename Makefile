# The README's two commands: `make demo` and `make test`. Both (re)create the virtual
# environment when pyproject.toml or this Makefile changed, then run the main job / the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# MXNet 1.9.1 (retired upstream; the last release) needs numpy < 1.24, so it has its own environment;
# `polyamp compare` runs its cases with that interpreter.
MXNET_VENV := .venv-mxnet
MXNET_PY := $(MXNET_VENV)/bin/python
MXNET_STAMP := $(MXNET_VENV)/.installed
# timm needs torchvision, and none of PyPI's torchvision releases imports beside torch's CPU wheel
# (2.13.0): the timm tests have an environment of their own with torch 2.14.1 and its torchvision 0.29.1
# (a CUDA build of about 5.5 GB, run on the CPU)
TIMM_VENV := .venv-timm
TIMM_PY := $(TIMM_VENV)/bin/python
TIMM_STAMP := $(TIMM_VENV)/.installed
FRAMEWORKS ?= torch,tensorflow,jax
export POLYAMP_TEST_FRAMEWORKS ?= $(FRAMEWORKS)

.PHONY: demo test venv venv-mxnet venv-timm lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel; any other version pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[fast,torch,tensorflow,jax,dev,bench,compare,doctor,models,hosts]"
	# keras-hub without tensorflow-text (pyproject.toml, the models extra)
	$(PY) -m pip install --quiet --no-deps "keras-hub>=0.32,<0.33" kagglesdk
	touch $(STAMP)

venv-mxnet: $(MXNET_STAMP)

$(MXNET_STAMP): pyproject.toml Makefile
	test -x $(MXNET_PY) || $(PYTHON) -m venv $(MXNET_VENV)
	$(MXNET_PY) -m pip install --quiet --upgrade pip
	# scikit-learn: the digits workload of `polyamp compare`; doctor: the heat map of `polyamp doctor`
	$(MXNET_PY) -m pip install --quiet -e ".[mxnet,dev,doctor]" "numpy<1.24" scikit-learn
	touch $(MXNET_STAMP)

venv-timm: $(TIMM_STAMP)

$(TIMM_STAMP): pyproject.toml Makefile
	test -x $(TIMM_PY) || $(PYTHON) -m venv $(TIMM_VENV)
	$(TIMM_PY) -m pip install --quiet --upgrade pip
	$(TIMM_PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(TIMM_PY) -m pip install --quiet -e ".[dev,timm]"
	touch $(TIMM_STAMP)

# The main job: every installed framework, workload and policy side by side (about 5 minutes here).
demo: venv venv-mxnet
	$(PY) -m polyamp cast 68.00000356923152 --to fp16,bf16,e4m3fn,e5m2,e2m1fn
	$(PY) -m polyamp compare --out compare-report

test: venv venv-mxnet venv-timm
	$(PY) -m ruff check src tests benchmarks examples
	# two workers (both cores), each test file in one of them: most tests spend one core tracing and compiling
	POLYAMP_REQUIRE_NUMBA=1 $(PY) -m pytest -q -n 2 --dist loadfile
	# MXNet and polyamp's core under numpy 1.23, in MXNet's own environment (two workers here too)
	POLYAMP_TEST_FRAMEWORKS=mxnet $(MXNET_PY) -m pytest -q -n 2 --dist loadfile tests/test_mxnet.py tests/test_contract.py tests/test_front_ends.py tests/test_compare_workloads.py \
		tests/test_formats.py tests/test_rounding.py tests/test_policy.py tests/test_scaling.py tests/test_import.py \
		tests/test_doctor_core.py tests/test_doctor_chain.py tests/test_doctor_mxnet.py tests/test_blocks.py tests/test_recipes.py tests/test_mxnet_recipes.py tests/test_mxnet_recipe_conv.py \
		tests/test_hadamard.py tests/test_quantize_frameworks.py tests/test_recipes_frameworks.py tests/test_recipe_conv_frameworks.py tests/test_doctor_blocks.py tests/test_doctor_binning.py tests/test_mxnet_tune.py tests/test_models_mxnet.py tests/test_models_docs.py
	# side by side, each in one process, its output kept apart until all three end: Keras 3 on its JAX and
	# torch backends (polyamp.keras; Keras picks its backend once per process), and timm's ResNet and ViT in
	# their own environment (torch 2.14.1: TIMM_VENV above)
	mkdir -p build/test-logs
	KERAS_BACKEND=jax $(PY) -m pytest -q tests/test_keras_backends.py > build/test-logs/keras-jax.log 2>&1 & a=$$!; \
	KERAS_BACKEND=torch $(PY) -m pytest -q tests/test_keras_backends.py > build/test-logs/keras-torch.log 2>&1 & b=$$!; \
	POLYAMP_TEST_FRAMEWORKS=torch,timm $(TIMM_PY) -m pytest -q tests/test_models_timm.py > build/test-logs/timm.log 2>&1 & c=$$!; \
	status=0; for pid in $$a $$b $$c; do wait $$pid || status=1; done; \
	for log in keras-jax keras-torch timm; do echo "== $$log"; tail -n 25 build/test-logs/$$log.log; done; exit $$status

bench: venv
	$(PY) benchmarks/quantize.py

clean:
	rm -rf $(VENV) $(MXNET_VENV) $(TIMM_VENV) build src/*.egg-info .pytest_cache
