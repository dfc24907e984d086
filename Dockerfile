# The operator image the Helm chart runs. Not built by CI here (no container engine on these
# machines); build it where you have one: docker build -t ghcr.io/settle-dev/settle:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin settle

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/settle /usr/local/bin/settle
USER 65532:65532
EXPOSE 8443 8080
ENTRYPOINT ["/usr/local/bin/settle"]
CMD ["operator"]
