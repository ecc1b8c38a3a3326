# Entry points that work on a fresh clone: `make lab`, `make test`, `make demo`, `make bench`, `make soak`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: lab demo test bench soak sim clean

$(BIN)/gpufrac-agent: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# JupyterHub's proxy, which only tests/hub uses: configurable-http-proxy from npm, kept inside
# the venv. Only `make test` asks for it, so `make lab` and `make demo` need no npm for it.
CHP := $(VENV)/chp/node_modules/.bin/configurable-http-proxy
$(CHP): | $(BIN)/gpufrac-agent
	npm install --prefix $(VENV)/chp --no-audit --no-fund --loglevel=error configurable-http-proxy@5

# Every kernel gets its GPU lease through the provisioner; with no agent running, the
# server embeds one (NVML when it starts, otherwise a simulated 2-GPU node). The Lab serves
# a folder of its own (ignored by git, ruff and pytest), so the notebooks and files made in
# "Try it" never reach the checkout's lint or tests; its terminals find gpufrac-agent on PATH.
NOTEBOOKS ?= notebooks
lab: $(BIN)/gpufrac-agent
	mkdir -p $(NOTEBOOKS)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/jupyter lab \
		--KernelProvisionerFactory.default_provisioner_name=gpufrac-provisioner \
		--ServerApp.root_dir=$(NOTEBOOKS) $(if $(filter 0,$(shell id -u)),--allow-root)

demo: $(BIN)/gpufrac-agent
	$(BIN)/gpufrac-agent demo

test: $(BIN)/gpufrac-agent $(CHP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	# Two workers, each taking whole test files (a file's servers and agents are set up once).
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

# A long randomized sequence of moves, kills and restarts against an undisturbed reference kernel.
SOAK_STEPS ?= 2000
soak: $(BIN)/gpufrac-agent
	GPUFRAC_SOAK_STEPS=$(SOAK_STEPS) GPUFRAC_SOAK_FIGURES=soak-figures.txt \
		$(BIN)/python -m pytest -q -s tests/e2e/test_sequences.py -k soak -p no:cacheprovider \
		-o timeout=0

# Kishu, the other checkpoint contender, in a venv of its own: it pins backports and Flask.
# Its `kishu` command is the target: it exists once both installs have succeeded.
KISHU := $(VENV)-kishu/bin/python
$(VENV)-kishu/bin/kishu:
	$(PYTHON) -m venv $(VENV)-kishu
	$(VENV)-kishu/bin/pip install --quiet torch==2.13.0
	$(VENV)-kishu/bin/pip install --quiet kishu==0.3.4

bench: $(BIN)/gpufrac-agent $(VENV)-kishu/bin/kishu
	# dill, the checkpoint benchmark's contender (not a dependency of the project).
	$(BIN)/pip install --quiet dill
	$(BIN)/python bench/agent_bench.py
	$(BIN)/python bench/checkpoint_bench.py
	$(BIN)/python bench/kishu_bench.py --python $(KISHU)
	$(BIN)/python bench/migration_bench.py
	$(BIN)/python bench/oom_bench.py
	$(BIN)/python bench/load_bench.py --seconds 30 --pace 1
	$(BIN)/python bench/load_bench.py --seconds 30

# Replays the notebook and job traces under each site policy; writes docs/simulation/.
SIM_TRACES ?= ../shared/traces
sim: $(BIN)/gpufrac-agent
	$(BIN)/gpufrac-agent simulate --trace $(SIM_TRACES)/adobe-sensei-notebooks-2021-06.json \
		--jobs $(SIM_TRACES)/alibaba-gpu-v2023-pods.csv --node 8xA100-80GB --out docs/simulation

clean:
	rm -rf $(VENV) $(VENV)-kishu
