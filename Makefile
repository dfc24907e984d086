# Settle's two commands: `make demo` runs the main job locally, `make test` runs every test.
.PHONY: test check demo build image crds reference tools env-up env-down env-status bench chaos lint clean

test:            ## build what is missing, start the real environment, run every test, stop it
	hack/test.sh

check:           ## the quick tier: lint, and every test that needs no environment (about two minutes warm)
	hack/check.sh

demo:            ## run Settle locally against a real API server and brokers
	hack/demo.sh

build:
	cargo build --release --locked --bin settle --bin kubectl-settle

image:           ## the operator and example images as OCI archives, offline and reproducible, the operator with its bill of materials (target/image/)
	hack/image.sh build

crds:            ## regenerate crds/ and its copies (chart, kustomize) from the Rust types
	cargo run --quiet --bin settle -- crds > crds/settle.yaml
	cp crds/settle.yaml charts/settle/crds/settle.yaml
	cp crds/settle.yaml config/crd/settle.yaml

reference:       ## regenerate docs/reference/{flags,metrics,conditions,values}.md and conformance/admission.json from the code
	SETTLE_WRITE_REFERENCE=1 cargo test --locked --quiet -p settle-operator --test reference
	SETTLE_WRITE_REFERENCE=1 cargo test --locked --quiet -p settle --test admission_rules

tools:           ## install the pinned kube-apiserver+etcd, nats-server, helm, kube-score, promtool, ElasticMQ (target/tools) and RabbitMQ (apt)
	hack/tools.sh build

env-up:          ## start kube-apiserver+etcd, nats-server, RabbitMQ, ElasticMQ on 127.0.0.1; writes target/env/settle.env
	hack/env.sh up

env-down:
	hack/env.sh down

env-status:
	hack/env.sh status

bench:           ## run the benchmarks against a real environment (prints figures)
	hack/env.sh up
	cargo bench --workspace
	. target/env/settle.env && cd clients/go && go run ./cmd/bench

chaos:           ## a fault campaign on the real environment: BROKER= (nats, nats-cluster, rabbitmq, sqs), SEED= (else drawn), FAULTS= (30), MESSAGES=, KINDS= (the first kinds of fault only)
	hack/env.sh up $(if $(filter nats-cluster,$(BROKER)),--nats-cluster)
	cargo build --profile bench -p settle-examples --example account_app
	cargo bench -p settle-operator --bench chaos -- $(if $(BROKER),--broker $(BROKER)) $(if $(SEED),--seed $(SEED)) --faults $(or $(FAULTS),30) $(if $(MESSAGES),--messages $(MESSAGES)) $(if $(KINDS),--kinds $(KINDS))

lint:            ## rustfmt, clippy, gofmt and go vet (clients/go), every crate's license and source (hack/crates.py), and shellcheck over the scripts (installs shellcheck with apt when missing)
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	cd clients/go && test -z "$$(gofmt -l .)" || { gofmt -l .; echo 'gofmt: run gofmt -w clients/go'; exit 1; }
	cd clients/go && go vet ./...
	python3 hack/crates.py
	hack/tools.sh build shellcheck
	shellcheck -x hack/*.sh .ci/run

clean: env-down
	cargo clean
