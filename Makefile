# Settle's two commands: `make demo` runs the main job locally, `make test` runs every test.
.PHONY: test demo build crds tools env-up env-down env-status bench lint clean

test:            ## build what is missing, start the real environment, run every test, stop it
	hack/test.sh

demo:            ## run Settle locally against a real API server and nats-server
	hack/demo.sh

build:
	cargo build --release

crds:            ## regenerate crds/ and its copies (chart, kustomize) from the Rust types
	cargo run --quiet -- crds > crds/settle.yaml
	cp crds/settle.yaml charts/settle/crds/settle.yaml
	cp crds/settle.yaml config/crd/settle.yaml

tools:           ## build the pinned kube-apiserver+etcd, nats-server, helm and kube-score (cached under target/tools)
	hack/tools.sh build

env-up:          ## start kube-apiserver+etcd and nats-server on 127.0.0.1; writes target/env/settle.env
	hack/env.sh up

env-down:
	hack/env.sh down

env-status:
	hack/env.sh status

bench:           ## run the benchmarks against a real environment (prints figures)
	hack/env.sh up
	cargo bench

lint:
	cargo fmt --check
	cargo clippy --all-targets --locked -- -D warnings

clean: env-down
	cargo clean
