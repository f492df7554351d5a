# The two commands of the README:
#   make run   — set up (venv, llama-server, demo model) and run the gateway on gateway.yaml
#   make test  — set up and run the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test setup bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
	$(BIN)/llama-gateway install-llama-server
	$(BIN)/llama-gateway demo-model
	@# nginx is only used by the proxy-buffering test (field case 19), which skips without it.
	@# Installed only when running as root with apt-get (never prompts for sudo).
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx >/dev/null; } || \
	  echo "nginx not installed: the nginx proxy test will be skipped"

run: setup
	$(BIN)/llama-gateway serve -c gateway.yaml

test: setup
	$(BIN)/python -m pytest -q -rs
