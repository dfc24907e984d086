# The operator image the Helm chart runs (ghcr.io/settle-dev/settle:<chart appVersion>), for those
# who build with Docker: docker build -t ghcr.io/settle-dev/settle:0.1.0 .
# `make image` (hack/image.sh) builds the same image offline, without a container engine, as an
# OCI archive: the same user, entrypoint, command, ports and files, from Debian 12's packages
# (the files gcr.io/distroless/cc-debian12 holds for this binary); tests/image.rs compares the two.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
# The whole workspace: every member's manifest must parse (with the test and bench targets it
# names), and settle-operator's build.rs lays the operator's code out from
# crates/settle-operator/link/hot-functions.txt.
COPY crates ./crates
RUN cargo build --release --locked --bin settle

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/settle /usr/local/bin/settle
USER 65532:65532
# The chart's ports: webhook (8443), metrics (8080), probes (8081).
EXPOSE 8443 8080 8081
ENTRYPOINT ["/usr/local/bin/settle"]
CMD ["operator"]
