# The two commands of the README:
#   make run   — set up (venv, llama-server, demo model) and run the gateway on gateway.yaml
#   make test  — set up and run the whole test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: run test setup test-deps browser

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

# Test-only system packages: nginx (proxy-buffering test, field case 19) and headless Chromium
# (status-page screenshot). Installed only when missing and running as root with apt-get (CI
# runs as root); otherwise the tests that need them skip and say why. Never prompts for sudo.
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -q
test-deps:
	@for pkg in nginx:nginx chromium:chromium; do \
	  bin=$${pkg%%:*}; deb=$${pkg##*:}; \
	  command -v $$bin >/dev/null 2>&1 || [ -x /usr/sbin/$$bin ] && continue; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    $(APT_INSTALL) $$deb >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1; $(APT_INSTALL) $$deb >/dev/null 2>&1; } \
	      || echo "make test-deps: could not install $$deb; the tests that need it will skip"; \
	  else echo "make test-deps: $$deb missing (not root); the tests that need it will skip"; fi; \
	done

test: setup test-deps
	$(BIN)/python -m pytest -q -rs
