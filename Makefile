# coreply: `make serve` (install + serve the built-in default), `make test` (install + run the tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lock serve test test-full lint containers soak results-cpu results-gpu clean

# The pinned CPU torch goes in first: an unpinned torch would pull several GB of CUDA packages.
# The rest at the versions in constraints.txt, those CI tested (`make lock` re-resolves them).
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lock:
	PY=$(PY) bash scripts/lock.sh

serve: install
	$(BIN)/coreply serve

test: install
	$(BIN)/python -m pytest -q

# Also the tests that need the real all-MiniLM-L6-v2 weights (slow) and CUDA (skipped without it).
test-full: install
	$(BIN)/python -m pytest -q -m ""

# Code and its layers (ruff, import-linter: pyproject.toml), Dockerfiles (hadolint), Prometheus config and alert rules and their unit tests (promtool, Debian package `prometheus`),
# Kubernetes manifests against the API schemas (strict: unknown fields fail), shell scripts (shellcheck: the GPU lease's
# script has no second try).
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/hadolint docker/Dockerfile docker/Dockerfile.gpu
	@command -v promtool >/dev/null || { echo "promtool missing: apt-get install prometheus" >&2; exit 1; }
	promtool check config docker/prometheus/prometheus.yml
	promtool check rules docker/prometheus/alerts.yml
	promtool test rules docker/prometheus/alerts.test.yml
	$(BIN)/kubernetes-validate --strict --quiet deploy/*.yaml
	$(BIN)/shellcheck --severity=warning scripts/*.sh

# The images built and run for real with podman (as root: installs podman, runc and debootstrap, makes a local
# Debian base): CPU image served, scraped and drained; GPU image with a CPU torch; compose with Prometheus.
containers: install
	bash scripts/containers.sh

# One hour of steady load on the default bundle: memory growth and latency drift (docs/reliability.md).
soak: install
	$(BIN)/python bench/soak.py --bundle artifacts/default-bundle --minutes 60 --out docs/soak-cpu.json

results-cpu: install
	PATH=$(abspath $(BIN)):$$PATH SCALE=cpu bash scripts/results_table.sh

results-gpu: install
	PATH=$(abspath $(BIN)):$$PATH SCALE=gpu bash scripts/results_table.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
