# pgfence container image: a release build on Debian bookworm.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p pgfence --locked \
 && cp target/release/pgfence /usr/local/bin/pgfence

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --no-create-home --shell /usr/sbin/nologin pgfence
COPY --from=build /usr/local/bin/pgfence /usr/local/bin/pgfence
USER pgfence
EXPOSE 6432 9187
ENTRYPOINT ["/usr/local/bin/pgfence"]
CMD ["--config", "/etc/pgfence/pgfence.toml"]
