# Every target bootstraps .venv (Python 3.11, pinned requirements) on first use and reuses it after.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROFILE ?= cpu

.PHONY: reproduce test lab paper lint venv clean-runs

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; assert sys.version_info[:2] == (3, 11), "macroarch needs Python 3.11, .venv has %s" % sys.version.split()[0]'
	$(BIN)/python -m pip install --quiet --requirement requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	@touch $@

# The main job: every notebook of the cpu profile (W&B offline unless configured), then paper/.
reproduce: $(STAMP)
	$(BIN)/macroarch reproduce --profile $(PROFILE)

test: $(STAMP)
	$(BIN)/python -m pytest

paper: $(STAMP)
	$(BIN)/macroarch paper --profile $(PROFILE)

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

lint: $(STAMP)
	$(BIN)/ruff check macroarch tests benchmarks data_scripts

clean-runs:
	rm -rf papermill_runs/out wandb
