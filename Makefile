# verl-sat developer commands. `make install` is idempotent: it re-runs only when setup.py changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl-sat-installed
WORKDIR ?= verl_sat_work

.PHONY: install doctor demo test bench lint clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch lies on disk; install it first so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

doctor: install
	$(VENV)/bin/verl-sat doctor

# the main job: prepare the embedded engine's model and task (once), then SAT-GSPO with routing replay at lag 8
demo: install
	$(VENV)/bin/verl-sat prepare --workdir $(WORKDIR) --if-needed
	$(VENV)/bin/verl-sat train --workdir $(WORKDIR) +recipe=sat_gspo_r3 +lag=lag8

test: install
	$(PY) -m pytest tests -q

bench: install
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_routing_replay.py
	$(PY) benchmarks/bench_embedded.py --workdir $(WORKDIR)

lint: install
	$(VENV)/bin/ruff check verl_sat tests benchmarks recipes setup.py
	$(VENV)/bin/ruff format --check verl_sat tests benchmarks recipes setup.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
