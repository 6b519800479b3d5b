# Every target bootstraps .venv (Python 3.11, pinned requirements) on first use and reuses it after.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROFILE ?= cpu

.PHONY: reproduce test compat lab paper runs view docs lint venv lock clean-runs nbfilter nbmeta

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; assert sys.version_info[:2] == (3, 11), "macroarch needs Python 3.11, .venv has %s" % sys.version.split()[0]'
	$(BIN)/python -m pip install --quiet --requirement requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	@# JupyterLab's kernel for the notebooks (they ask for "macroarch": this venv's python), and git's filter that
	@# keeps committed notebooks output-stripped whatever a user runs or saves in them
	$(BIN)/python -m ipykernel install --sys-prefix --name macroarch --display-name "Python 3 (macroarch)" >/dev/null
	@$(MAKE) --no-print-directory nbfilter
	@touch $@

# git's clean filter for notebooks, as .gitattributes names it: nbstripout with cell ids kept (its own --install
# drops --keep-id and writes *.ipynb into .git/info/attributes, which outranks .gitattributes and so would strip the
# paper's evidence notebooks too: such lines of an older checkout are removed), then one index refresh, so that git
# status (each run records the commit) does not filter every notebook of a fresh clone again.
NBSTRIP := "$(abspath $(BIN))/python" -m nbstripout
nbfilter:
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
	  git config filter.nbstripout.clean '$(NBSTRIP) --keep-id' && git config filter.nbstripout.smudge cat && \
	  git config filter.nbstripout.required true && git config diff.ipynb.textconv '$(NBSTRIP) -t' && \
	  info="$$(git rev-parse --git-path info/attributes)" && \
	  { [ ! -f "$$info" ] || sed -i '/filter=nbstripout/d; /diff=ipynb/d' "$$info"; } && \
	  { git update-index -q --refresh >/dev/null || true; }; fi

# The notebooks' kernelspec and language_info as JupyterLab writes them on opening (so that opening one does not mark
# it modified): after a Python upgrade of .venv, then commit the notebooks.
nbmeta: $(STAMP)
	$(BIN)/python -m macroarch.repro.nbmeta

# The main job: every notebook of the cpu profile (W&B offline unless configured), then paper/.
reproduce: $(STAMP)
	$(BIN)/macroarch reproduce --profile $(PROFILE)

# The compatibility subset on the older supported torch (when its wheel is on disk), then the whole suite on the lock's.
test: $(STAMP)
	@if [ -f $(COMPAT_WHEEL) ]; then $(MAKE) --no-print-directory compat; \
	  else echo "make test: SKIPPED the torch $(COMPAT_TORCH) compatibility subset (no wheel at $(COMPAT_WHEEL))"; fi
	$(BIN)/python -m pytest

# tests/compat in a scratch venv that holds torch $(COMPAT_TORCH) first, then `pip install -e .` (which must keep it):
# the package's declared range, not the lock, is what a user's environment meets. Other packages follow the lock.
COMPAT_TORCH ?= 2.13.0
COMPAT_WHEEL ?= /opt/wheels/torch-$(COMPAT_TORCH)+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
COMPAT_VENV  := .venv-torch$(basename $(COMPAT_TORCH))
COMPAT_BIN   := $(COMPAT_VENV)/bin

$(COMPAT_VENV)/.installed: pyproject.toml requirements.txt
	@test -f $(COMPAT_WHEEL) || { echo "make compat: no torch $(COMPAT_TORCH) wheel at $(COMPAT_WHEEL)"; exit 1; }
	rm -rf $(COMPAT_VENV) && $(PYTHON) -m venv $(COMPAT_VENV)
	grep -v '^torch==' requirements.txt > $(COMPAT_VENV)/constraints.txt
	$(COMPAT_BIN)/python -m pip install --quiet --constraint $(COMPAT_VENV)/constraints.txt $(COMPAT_WHEEL)
	$(COMPAT_BIN)/python -m pip install --quiet --constraint $(COMPAT_VENV)/constraints.txt --editable . pytest
	$(COMPAT_BIN)/python -c 'import torch; v = torch.__version__; print("make compat: torch", v, "kept by pip install -e ."); \
	  assert v.split("+")[0] == "$(COMPAT_TORCH)", "pip replaced torch $(COMPAT_TORCH) with " + v'
	@touch $@

compat: $(COMPAT_VENV)/.installed
	@$(COMPAT_BIN)/python -c 'import torch; print("make compat: torch", torch.__version__, "in $(COMPAT_VENV)")'
	$(COMPAT_BIN)/python -m pytest tests/compat --confcutdir=tests/compat -p no:cacheprovider -q

# Merge the profile's latest results into its paper, claims.md, reproduction.md and reproduction.pdf (cpu: paper/;
# ci, gpu: papermill_runs/out/<profile>/paper/).
paper: $(STAMP)
	$(BIN)/macroarch paper --profile $(PROFILE)

# Result files and W&B offline runs; `make view` opens the latest W&B run in wandb's terminal viewer.
runs: $(STAMP)
	$(BIN)/macroarch runs --profile $(PROFILE)

view: $(STAMP)
	$(BIN)/wandb leet $${WANDB_DIR:-.}/wandb

# docs/claims.md's registry block, regenerated from macroarch/repro/claims.py (a test holds them equal).
docs: $(STAMP)
	$(BIN)/python -c 'import re, pathlib; from macroarch.repro.cli import claims_markdown; \
	  p = pathlib.Path("docs/claims.md"); a, b = "<!-- registry: generated by `macroarch claims --markdown` -->\n", "<!-- /registry -->"; \
	  t = p.read_text(); p.write_text(t.split(a)[0] + a + claims_markdown() + b + t.split(b)[1])'

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check macroarch tests benchmarks data_scripts

# Re-resolve requirements.in into the fully pinned requirements.txt (in a scratch venv).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --requirement requirements.in
	{ echo "# Generated by \`make lock\` from requirements.in: every package pinned (Python 3.11). Do not edit by hand."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > requirements.txt
	rm -rf .venv-lock

clean-runs:
	rm -rf papermill_runs/out wandb
