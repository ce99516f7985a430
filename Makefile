# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch first, pinned: on a CPU machine this takes the local CPU wheel; an unpinned torch (or one
# pulled in by another package) would download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# megatron-core 0.19 (Megatron-LM 0.19's training loop) beside 0.16.1, for pretrain_scripts/pretrain_gpt_mcore019.py:
# runs that use it put this folder first on PYTHONPATH (megatron_ucp/megatron_lm/launch.py finds it).
MCORE019 := $(VENV)/megatron-core-0.19

.PHONY: demo test install clean

install: $(VENV)/.installed $(MCORE019)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# --ignore-requires-python: the cp311 wheel says >=3.12 but runs on 3.11 given typing.override (cpu_shims.py).
# --no-deps: what it imports at run time (torch, numpy, packaging) is already in the venv.
$(MCORE019)/.installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python --upgrade --target $(MCORE019) megatron-core==0.19.2
	touch $@

demo: install
	$(PY) -m megatron_ucp.commands.demo

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) demo_output .pytest_cache
