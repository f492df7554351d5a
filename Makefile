# The two commands of the README:
#   make run   — set up (venv, llama-server, demo model) and run the gateway on gateway.yaml
#   make test  — set up and run the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test setup bench browser

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
	$(BIN)/llama-gateway install-llama-server
	$(BIN)/llama-gateway demo-model

run: setup
	$(BIN)/llama-gateway serve -c gateway.yaml

# Headless Chromium for the status-page test (tests/e2e/test_service.py); installed only when
# missing and running as root with apt-get (CI); otherwise that test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
	  || echo "make browser: chromium not installed; the status page test will skip"; }

test: setup browser
	$(BIN)/python -m pytest -q -rs
