# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch first, pinned: on a CPU machine this takes the local CPU wheel; an unpinned torch (or one
# pulled in by another package) would download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(PY) -m megatron_ucp.demo

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) demo_output .pytest_cache
