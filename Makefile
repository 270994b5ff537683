# DDPJob — every entry point a newcomer or CI needs. `make demo` and `make test` are the two that matter.
SHELL := /bin/bash
PY    := .venv/bin/python
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/trainer:$(CURDIR)/cli:$(CURDIR)/store:$(CURDIR)

.PHONY: help deps binaries cluster-up cluster-down cluster-status image images generate \
        test test-unit test-trainer test-gpu test-cluster test-integration test-e2e test-chart \
        demo demo-down kind-e2e kind-node-loss kueue-up kueue-down \
        bench-trainer-recovery bench-baselines bench-overhead bench-resident-commit bench-e2e-recovery bench-startup bench-api \
        bench-scale bench-faults bench-kueue bench-node-loss bench-rdzv-scale bench-scale-sim bench-largest-job bench-report

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-24s %s\n", $$1, $$2}'

deps: ## system packages + .venv (idempotent)
	hack/install-deps.sh

binaries: ## build Kubernetes, etcd, CoreDNS, Helm, kube-router and Kueue from the Go module proxy (cached)
	hack/build-binaries.sh

cluster-up: deps binaries ## start the embedded single-node cluster (kubeconfig: .cluster/kubeconfig)
	$(PY) hack/cluster.py up

cluster-down: ## stop it and remove every trace
	$(PY) hack/cluster.py down

cluster-status: ## component health and memory
	$(PY) hack/cluster.py status

image: ## build one Dockerfile offline: make image NAME=x DOCKERFILE=path [TAG=0.1.0]
	$(PY) hack/image.py build -f $(DOCKERFILE) -t localhost/$(NAME):$(or $(TAG),0.1.0) .

images: ## build the operator, trainer and store images and import them into containerd
	hack/build-images.sh

generate: ## regenerate every copy of the CRD from its single source
	$(PY) -m ddp_operator.crd --write

.PHONY: release registry-up registry-down
release: ## push a release: make release VERSION=x.y.z [REGISTRY=host/path] [COMPRESSION=gzip] (images, chart, dist/VERSION/manifests.yaml; docs/install.md)
	$(if $(VERSION),,$(error VERSION=x.y.z is required, with an entry in CHANGELOG.md))
	hack/build-binaries.sh helm registry
	$(PY) hack/release.py $(VERSION) $(if $(REGISTRY),--registry $(REGISTRY)) $(if $(COMPRESSION),--compression $(COMPRESSION))

registry-up: ## the local release registry (127.0.0.1, a free port; make release's default) and containerd's way to it
	hack/build-binaries.sh registry
	$(PY) hack/registry.py up

registry-down: ## stop the local release registry (its storage stays in the cache)
	$(PY) hack/registry.py down

test: deps ## the whole suite, exactly as CI runs it (hack/test.sh: stages side by side where they can be; ends with the node-loss test on a kind cluster of its own)
	hack/test.sh

test-unit: ## pure unit tests (no cluster)
	$(PY) -m pytest -ra tests/unit

.PHONY: test-bootstrap
test-bootstrap: ## no Go on PATH, empty cache: the pinned Go toolchain is fetched, verified and builds etcd
	$(PY) -m pytest -ra tests/bootstrap

test-trainer: ## trainer tests: real torchrun agents on loopback
	$(PY) -m pytest -ra tests/trainer

test-gpu: ## on a machine with CUDA: the GPU sample's trainer path (NCCL, a worker per GPU, AMP, a killed worker) and the CUDA snapshot tests
	$(PY) -m pytest -q tests/gpu tests/trainer/test_snapshot_async.py

test-cluster: ## embedded-cluster tests
	$(PY) -m pytest -ra tests/cluster

test-integration: ## operator against the real API server
	$(PY) -m pytest -ra tests/integration

test-e2e: ## real pods running torchrun (embedded cluster or $$DDPJOB_TEST_KUBECONFIG, e.g. kind)
	$(PY) -m pytest -ra tests/e2e

.PHONY: test-metrics
test-metrics: ## the per-job metrics and every dashboard query against a real Prometheus (built first; no cluster)
	hack/build-binaries.sh prometheus
	$(PY) -m pytest -ra tests/metrics

test-chart: ## helm lint, template validation, install/upgrade/uninstall
	$(PY) -m pytest -ra tests/chart

demo: ## fresh machine → cluster, images, chart, a digits job that survives a killed pod
	hack/demo.sh

demo-down: ## remove what the demo added
	hack/demo.sh down

kind-e2e: ## the whole e2e suite on a 3-node kind cluster (offline: own Docker engine and node image)
	hack/install-deps.sh --docker
	hack/kind-e2e.sh

kind-node-loss: ## a kind worker stopped, then paused, under a training job (tests/e2e/test_e2e_node_loss.py on kind)
	hack/install-deps.sh --docker
	hack/kind-e2e.sh --node-loss

kueue-up: ## install Kueue (its own chart, image built offline) into the embedded cluster; seconds when installed
	$(PY) hack/kueue.py up

kueue-down: ## uninstall Kueue: its release, namespace kueue-system and its CRDs
	$(PY) hack/kueue.py down

# Every bench-* target prints its JSON and records it in docs/bench/<name>.json (commit, date, machine);
# `make bench-report` writes the README's Measured table and docs/recovery.md's baselines from those files.
bench-trainer-recovery: ## trainer recovery vs stock torchrun (JSON, docs/bench/trainer_recovery.json)
	$(PY) tests/benchmarks/trainer_recovery.py --compare-env DDPJOB_TAKE_OVER=0 --record

bench-baselines: ## stock torchrun as a skilled user sets it up, node kills on loopback (docs/bench/baselines.json)
	$(PY) tests/benchmarks/baselines.py --record

bench-overhead: ## snapshot/checkpoint overhead vs a bare DDP loop (JSON, docs/bench/trainer_overhead.json)
	$(PY) tests/benchmarks/trainer_overhead.py --record

bench-resident-commit: ## resident state's per-step commit cost by model size (docs/bench/resident_commit.json)
	$(PY) tests/benchmarks/resident_commit.py --record

bench-e2e-recovery: ## pod kills on the cluster (JSON, docs/bench/e2e_recovery.json)
	$(PY) tests/benchmarks/e2e_recovery.py --record

bench-startup: ## apply → running → first step vs hand-written pods (JSON, docs/bench/startup.json)
	$(PY) tests/benchmarks/startup.py --record

bench-kueue: ## behind a real Kueue: queued start, the hand-off to a waiting job, vs no Kueue (docs/bench/kueue_queue.json)
	$(PY) tests/benchmarks/kueue_queue.py --record

bench-api: ## API writes for one clean job at the default and the sample's progress period (docs/bench/api_writes.json)
	$(PY) tests/benchmarks/api_writes.py --record

bench-scale: ## 200 DDPJobs at once, control plane only (JSON, docs/bench/scale.json)
	$(PY) tests/benchmarks/scale.py --record

bench-faults: ## every fault once on the cluster: store/agent/worker/operator loss, hang, apiserver restart, NotReady node, every pod evicted (evict_all); per fault survived, recovery, steps lost, goodput (docs/bench/faults.json)
	$(PY) tests/benchmarks/faults.py --record

bench-node-loss: ## a kind worker stopped and frozen under a training job (docs/bench/node_loss.json)
	hack/install-deps.sh --docker
	KIND_RECORD=1 hack/kind-e2e.sh --node-loss

bench-rdzv-scale: ## the c10d rendezvous with 8-512 agents on loopback, torch's handler vs ddpjob-c10d, against the rdzv pod's store (docs/bench/rdzv_scale.json; --store torch: torch's own server)
	$(PY) tests/benchmarks/rdzv_scale.py --record

bench-scale-sim: ## the control plane at 10-1,000 nodes with kwok: one job, deletions, hang polls, node loss, 100x32, 1,000x1 and 100x36 jobs, a restart with 10,000 pods (docs/bench/scale_sim.json)
	hack/build-binaries.sh kwok
	$(PY) tests/benchmarks/scale_sim.py --record

bench-largest-job: ## the largest real job here: 8 pods x 1 process, two pods killed at once, then the store pod; bitwise vs an uninterrupted run (docs/bench/largest_job.json)
	$(PY) tests/benchmarks/largest_job.py --record

bench-report: ## rewrite the README's Measured table and docs/recovery.md's baselines from docs/bench/*.json
	$(PY) tests/benchmarks/report.py --write

.PHONY: bench-memory
bench-memory: ## the operator's memory under 1,500 labelled Pending pods of 64 KiB annotations (docs/bench/operator_memory.json)
	$(PY) tests/benchmarks/operator_memory.py --record

.PHONY: bench-elastic
bench-elastic: ## elastic jobs: kubectl scale down/up and a kill at the desired size, vs rdzvBackend c10d and a fixed job (docs/bench/elastic.json)
	$(PY) tests/benchmarks/elastic.py --record
