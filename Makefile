# Developer shortcuts; the README's commands are the source of truth.
.PHONY: install test test-gpu checkstyle bench
install:
	pip install torch==2.13.0 ninja && pip install --no-build-isolation -e ".[test]"
test:
	pytest
test-gpu:
	pytest -m gpu
checkstyle:
	ruff check pacs_megatron tests && ruff format --check pacs_megatron tests
bench:
	python -m pacs_megatron.bench.logprob && python -m pacs_megatron.bench.sync
