# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch first, pinned: on a CPU machine this takes the local CPU wheel; an unpinned torch (or one
# pulled in by another package) would download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# megatron-core, pinned: the release whose Megatron-LM training loop (megatron/training, in the wheel) the
# entry point, the plugin and cpu_shims are written for.
MCORE  ?= megatron-core==0.19.2
# emerging-optimizers, pinned: megatron-core 0.19 builds --optimizer lion, muon (and its layer-wise distributed
# optimizer) from it. Its wheel says Python >= 3.12 (typing.override, given on 3.11 by cpu_shims, as for
# megatron-core); --no-deps for the same reason (its only other dependency, absl-py, is pure Python, pinned here).
EOPT   ?= emerging-optimizers==0.3.0 absl-py==2.5.1

.PHONY: demo test install clean

install: $(VENV)/.installed

# --ignore-requires-python: megatron-core 0.19.2's cp311 wheel says >=3.12 but runs on 3.11 given
# typing.override (cpu_shims.py). --no-deps: what it imports at run time (torch, numpy, packaging) is
# installed by the project's own dependencies (pyproject.toml), next.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python "$(MCORE)"
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python $(EOPT)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(PY) -m megatron_ucp.commands.demo

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) demo_output .pytest_cache
