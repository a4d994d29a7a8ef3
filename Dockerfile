# syntax=docker/dockerfile:1
# The Rulebook operator image: `docker build -t ghcr.io/rulebook-dev/rulebook:0.1.0 .`
# (BuildKit, the default builder since Docker 23, for the cache mounts).
#
# Build: the release binary, exactly the locked dependencies. Runtime: distroless "cc"
# (glibc, libgcc, CA certificates, no shell), as user 65532 ("nonroot"). The builder is
# Debian 12 (bookworm) to match the runtime's glibc: move both together.
# The binary needs no file but the rules and templates it is pointed at (deploy/).

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# The registry and target caches persist across builds; the binary is copied out of the
# cached target directory within the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git/db \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release --bin rulebook \
 && install -D -m 0755 target/release/rulebook /out/rulebook

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="rulebook" \
      org.opencontainers.image.description="A Kubernetes operator driven by rule files" \
      org.opencontainers.image.source="https://github.com/rulebook-dev/rulebook"
COPY --from=build /out/rulebook /rulebook
USER 65532:65532
# /metrics, /healthz, /readyz, /status (run --metrics-addr)
EXPOSE 8080
ENTRYPOINT ["/rulebook"]
CMD ["run"]
