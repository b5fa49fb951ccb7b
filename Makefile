# longseq — `make train` and `make test` install what is missing first (a .venv in this folder).
PY      := .venv/bin/python
STAMP   := .venv/.installed
XLA_PY    := .venv-xla/bin/python
XLA_STAMP := .venv-xla/.installed
ARGS    ?=

.PHONY: help install train test test-slow bench gpu-check xla-check data-lra lint clean clean-logs notebooks

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# pyproject.toml states the supported torch range; tools/constraints/pinned.txt pins the release installed here
$(STAMP): pyproject.toml tools/constraints/pinned.txt
	@echo "make: setting up .venv (a Python virtual environment in this folder), once"
	@test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	@echo "make: upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "make: installing longseq and its pinned dependencies (torch, lightning, hydra ...: a few GB, often 2 minutes or more; pip prints only errors)"
	@$(PY) -m pip install --quiet -c tools/constraints/pinned.txt -e '.[dev]'
	@touch $(STAMP)
	@echo "make: installed; the next make commands start at once"

install: $(STAMP)  ## create .venv and install the package with pinned dependencies (idempotent)

# torch 2.9.0 (what the newest torch_xla needs) + torch_xla 2.9.0 + the project's other pins, in a venv of its own
$(XLA_STAMP): pyproject.toml tools/constraints/xla.txt
	test -x $(XLA_PY) || python3.11 -m venv .venv-xla || python3 -m venv .venv-xla
	$(XLA_PY) -m pip install --quiet --upgrade pip
	$(XLA_PY) -m pip install --quiet -c tools/constraints/xla.txt torch_xla -e '.[dev]'
	touch $(XLA_STAMP)

train: $(STAMP)  ## train the default job (digits, full attention, CPU, a few minutes); extra overrides via ARGS="..."
	$(PY) train.py $(ARGS)

test: $(STAMP)  ## the fast test suite (CPU, a few minutes; two pytest workers)
	$(PY) -m pytest -q -n 2 $(ARGS)

test-slow: $(STAMP)  ## the slow suite: every attention through the train.py CLI, longer runs
	$(PY) -m pytest -q -n 2 -m slow $(ARGS)

bench: $(STAMP)  ## attention speed/memory benchmark (logs/bench/<timestamp>/)
	$(PY) -m longseq.bench $(ARGS)

gpu-check: $(STAMP)  ## verify a CUDA machine: host calibration, correctness of every attention x backend (fp32, bf16), Fig. 3 on the device, each layer as called and replayed in a CUDA graph (kernels per step), bf16-mixed training eager / compiled / CUDA graphs (MFU), DDP; report in logs/gpu_check/<timestamp>/ (ARGS="dry=true": CPU, tiny sizes)
	$(PY) -m longseq.bench.gpu $(ARGS)

xla-check: $(XLA_STAMP)  ## the XLA path on XLA's CPU device (own env .venv-xla, ~7 GB): every attention vs CPU, compiles per step, train.py trainer=tpu; report in logs/xla_check/<timestamp>/
	PJRT_DEVICE=CPU $(XLA_PY) -m longseq.bench.xla $(ARGS)

data-lra: $(STAMP)  ## generate ListOps + Pathfinder-32 locally into data/lra (seeded; NOT the released LRA splits)
	$(PY) -m longseq.data.lra.prepare --root data/lra --workers 2
	$(PY) -m longseq.data.lra.prepare --root data/lra_listops_smoke --only listops --listops-sizes 20000 1000 1000 --listops-max-depth 4 --listops-min-length 20 --listops-max-length 200

notebooks: $(STAMP)  ## execute notebooks/*.ipynb top to bottom; executed copies in logs/notebooks/ (stored ones stay clean)
	$(PY) -m longseq.report.notebooks $(ARGS)

lint: $(STAMP)  ## ruff (installed on demand)
	$(PY) -m pip install --quiet ruff==0.17.*
	$(PY) -m ruff check src tests train.py eval.py

clean:  ## remove caches and build leftovers (keeps .venv, data/ and logs/)
	rm -rf build dist src/*.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './.venv/*' -exec rm -rf {} +

clean-logs:  ## remove every run under logs/
	rm -rf logs/*
