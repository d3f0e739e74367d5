//! Node.js drivers through pgfence: each script of `tests/node/` is run directly against
//! PostgreSQL (which checks the scripts' own expectations), then through pgfence with the
//! fence on (fast path on, and off so the database rejects every stale write) and with the
//! fence off; env `PGFENCE_FENCE` tells the script whether stale writes must be rejected.
//! Every expected test of each script must report `ok`.
//!
//! - [`node_postgres_direct_and_through_pgfence`]: node-postgres, pg-copy-streams and
//!   pg-cursor, `tests/node/test_pg.js`.
//! - [`postgres_js_direct_and_through_pgfence`]: postgres.js, `tests/node/test_postgres_js.js`.

use harness::{node_or_skip, run_in_every_fence_mode, try_run_node};

const PG_TESTS: &[&str] = &[
    "parameters",
    "transactions",
    "token_sources",
    "stale_token",
    "first_write_fails",
    "copy_from_stale_in_transaction",
    "copy",
    "copy_to_stale",
    "discard_then_writes",
    "cursor",
    "listen_notify",
    "cancel",
];

const POSTGRES_JS_TESTS: &[&str] = &[
    "parameters",
    "transactions",
    "token_sources",
    "stale_token",
    "first_write_fails",
    "pipeline_error_mid_pipeline",
    "pipeline_first_write_fails_reused_connection",
    "discard_then_writes",
    "copy_to_stale",
    "copy_from_stale_in_transaction",
    "cursor",
    "listen_notify",
    "cancel",
];

#[test]
fn node_postgres_direct_and_through_pgfence() {
    run_everywhere(
        "node_postgres_direct_and_through_pgfence",
        "test_pg.js",
        PG_TESTS,
    );
}

#[test]
fn postgres_js_direct_and_through_pgfence() {
    run_everywhere(
        "postgres_js_direct_and_through_pgfence",
        "test_postgres_js.js",
        POSTGRES_JS_TESTS,
    );
}

fn run_everywhere(test: &str, script: &str, tests: &[&str]) {
    if node_or_skip(test).is_none() {
        return;
    }
    run_in_every_fence_mode(script, tests, try_run_node);
}
