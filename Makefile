# Two commands set everything up on a fresh machine: `make test` and `make train`/`make profile`.
PYTHON_SYS ?= python3
# Extra pip options. On Linux PyPI's torch wheel is the CUDA build (several GB); for the CPU-only one:
# make test PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
# A venv whose interpreter no longer runs (its base Python removed or upgraded) loses its stamp,
# so setup rebuilds it instead of every target failing on a missing .venv/bin/python.
ifneq ($(wildcard $(VENV)/.installed-*),)
ifneq ($(shell $(PY) -c 'print(1)' 2>/dev/null),1)
$(shell rm -f $(VENV)/.installed-*)
endif
endif

.PHONY: setup test demo train profile sample lint format gpu-check gpu-wheels clean clean-runs

setup: $(STAMP)

# Re-runs only when requirements.txt's content changes, as the stamp's name holds its checksum
# (not its date: a checkout that rewrites the same file reinstalls nothing; not PYTHON_SYS or
# PIP_ARGS: make clean first). A venv without pip (a failed ensurepip) or with a Python older
# than 3.11 (no tomllib) is rebuilt, not reused.
$(STAMP):
	@$(PY) -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		rm -rf $(VENV); \
		$(PYTHON_SYS) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "$(PYTHON_SYS) is Python %d.%d; 3.11 or newer is needed (tomllib): make PYTHON_SYS=python3.12 ..." % sys.version_info[:2])' \
		&& $(PYTHON_SYS) -m venv $(VENV); }
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_ARGS) -r requirements.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

test: setup
	$(PY) -m pytest

demo: setup
	$(PY) scripts/demo.py

# Prepares the standard-library corpus where there is none, trains, saves, prints a sample.
# Again into the same run: make train ARGS=--resume. Another run: ARGS="--model.attention=naive
# --out runs/naive" (MAKE_TRAIN=1: train.py's advice to resume then reads as make's). A corpus
# that is there is kept: prepared again after the Python changed, it would be another standard
# library's, and the runs trained on it could not resume (train.py says how to rebuild one that
# is damaged).
train: setup
	test -f data/stdlib/meta.json || $(PY) data/prepare.py --name stdlib --stdlib
	MAKE_TRAIN=1 $(PY) train.py --config configs/default.toml --out runs/default $(ARGS)

sample: setup
	$(PY) sample.py --run runs/default $(ARGS)

# The CPU sweep: every variant that runs here x n_layer 1,2,4,8; prints the summary table.
profile: setup
	$(PY) profile_train.py --config configs/profile.toml $(ARGS)

# On a CUDA machine: CUDA tests + the GPU sweep, with whatever python3 has torch there.
gpu-check:
	bash scripts/gpu_check.sh $(or $(OUT),gpu-check)

# Wheels of the tools gpu_check.sh needs, at the versions pinned here, for a GPU machine with
# no network: carry .gpu-wheels there and run with WHEELS=.gpu-wheels. GPU_PY: its Python
# (3.12 by default; an image that already has all four needs none).
GPU_PY ?= 3.12
gpu-wheels: setup
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(GPU_PY) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .gpu-wheels $(shell grep -E '^(tqdm|pytest|matplotlib|numpy)==' requirements.txt)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The environment and caches; trained runs and profiles stay (see clean-runs).
clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .gpu-wheels

# Deletes every trained run (checkpoints included) and every profile sweep.
clean-runs:
	rm -rf runs profiles
