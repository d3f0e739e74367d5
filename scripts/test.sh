#!/usr/bin/env bash
# The test command (see README): installs missing dependencies, builds the `pgfence` binary
# that the process-level tests run, then `cargo test --workspace` with any extra arguments
# (e.g. `scripts/test.sh --release`, `scripts/test.sh -- --nocapture`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/install-deps.sh

# harness::ProxyProcess runs target/<profile>/pgfence; cargo test does not build it for us.
build_args=()
for arg in "$@"; do
    [[ $arg == -- ]] && break
    [[ $arg == --release ]] && build_args+=(--release)
done
cargo build -p pgfence --bins ${build_args[@]+"${build_args[@]}"}
cargo test --workspace "$@"
