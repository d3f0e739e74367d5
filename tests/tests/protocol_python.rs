//! Python drivers through pgfence, each script run directly against PostgreSQL (which checks
//! the scripts' own expectations), then through pgfence (PGFENCE_DSN). Every test of each
//! script must report `ok`.
//!
//! - [`psycopg_scripts_direct_and_through_pgfence`]: psycopg 3, `tests/python/test_smoke.py`,
//!   `tests/python/test_protocol.py` and `tests/python/test_psycopg_advanced.py`, through
//!   pgfence with the fence on and with it off.
//! - [`asyncpg_direct_and_through_pgfence`]: asyncpg, `tests/python/test_asyncpg.py`, through
//!   pgfence with the fence on (fast path on, and off so the database rejects every stale
//!   write) and with it off; the script expects stale writes rejected only where the fence
//!   is enforced (env `PGFENCE_FENCE`).
//! - [`sqlalchemy_direct_and_through_pgfence`]: SQLAlchemy 2 with its `postgresql+psycopg`
//!   and `postgresql+asyncpg` dialects, `tests/python/test_sqlalchemy.py` (ORM and Core,
//!   connect-time introspection and COPY with a stale token, the pool's reset-on-return,
//!   `begin_twophase()`, `begin_nested()`, insertmanyvalues), the same four ways.

use harness::{
    python_module_or_skip, python_or_skip, run_in_every_fence_mode, run_python, try_run_python,
    PgCluster, Proxy, APP_DB,
};

const SCRIPTS: &[(&str, &[&str])] = &[
    (
        "test_smoke.py",
        &[
            "parameterized_query",
            "pipeline",
            "copy",
            "server_side_cursor",
        ],
    ),
    (
        "test_protocol.py",
        &[
            "parameters",
            "autocommit",
            "pipeline",
            "copy",
            "server_side_cursor",
            "notifications",
            "cancel",
            "scram_login",
        ],
    ),
    (
        "test_psycopg_advanced.py",
        &[
            "pipeline_error_mid_pipeline",
            "pipeline_executemany",
            "pipeline_fenced_transaction",
            "pipeline_stale_token",
            "prepared_eviction",
            "prepare_threshold_runtime",
            "two_phase_commit",
            "failed_commit_then_lower_token",
            "statement_name_reparse",
            "named_cursor_fenced_transaction",
            "copy_binary",
            "autocommit_savepoints_set_token",
            "cancel_then_fenced_writes",
        ],
    ),
];

#[test]
fn psycopg_scripts_direct_and_through_pgfence() {
    if python_or_skip("psycopg_scripts_direct_and_through_pgfence").is_none() {
        return;
    }
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let fenced = Proxy::for_cluster(&cluster);
    let mut config = Proxy::config_for(&cluster);
    config.fence.enabled = false;
    let plain = Proxy::start(config);

    let direct = cluster.connstr(APP_DB);
    let targets = [
        ("direct", None),
        ("fence on", Some(fenced.connstr(APP_DB))),
        ("fence off", Some(plain.connstr(APP_DB))),
    ];
    for (mode, through) in &targets {
        for (script, tests) in SCRIPTS {
            let mut env = vec![("PG_DIRECT_DSN", direct.as_str())];
            if let Some(dsn) = through {
                env.push(("PGFENCE_DSN", dsn.as_str()));
            }
            let out = run_python(script, &env);
            for name in *tests {
                assert!(
                    out.lines().any(|l| l.starts_with(&format!("ok {name} "))),
                    "{mode}: no `ok {name}` from {script} in:\n{out}"
                );
            }
            eprintln!("{mode} {script}:\n{out}");
        }
    }
}

/// What `scripts/install-deps.sh` installs for asyncpg.
const ASYNCPG_SPEC: &str = "asyncpg>=0.29,<1";

const ASYNCPG_TESTS: &[&str] = &[
    "statement_cache",
    "executemany",
    "session_token",
    "stale_token",
    "stale_executemany",
    "set_config_token",
    "error_then_fenced_write",
    "savepoints",
    "copy_records",
    "copy_out",
    "cursor",
    "cancel",
    "notifications",
    "custom_types",
    "invalidated_statement",
    "read_only_stale",
];

#[test]
fn asyncpg_direct_and_through_pgfence() {
    let test = "asyncpg_direct_and_through_pgfence";
    if python_module_or_skip(test, "asyncpg", ASYNCPG_SPEC).is_none() {
        return;
    }
    run_in_every_fence_mode("test_asyncpg.py", ASYNCPG_TESTS, try_run_python);
}

/// What `scripts/install-deps.sh` installs for SQLAlchemy: `asyncio` brings greenlet, which
/// its async engine needs (SQLAlchemy 2.1 no longer installs it by default).
const SQLALCHEMY_SPEC: &str = "SQLAlchemy[asyncio]>=2.0,<3";

/// Each for the `psycopg` (sync engine) and `asyncpg` (async engine) dialect.
const SQLALCHEMY_TESTS: &[&str] = &[
    "psycopg_orm_round_trip",
    "psycopg_stale_token",
    "psycopg_pool_reuse",
    "psycopg_two_phase",
    "psycopg_stale_two_phase",
    "psycopg_savepoints",
    "psycopg_executemany",
    "asyncpg_orm_round_trip",
    "asyncpg_stale_token",
    "asyncpg_pool_reuse",
    "asyncpg_two_phase",
    "asyncpg_stale_two_phase",
    "asyncpg_savepoints",
    "asyncpg_executemany",
];

#[test]
fn sqlalchemy_direct_and_through_pgfence() {
    let test = "sqlalchemy_direct_and_through_pgfence";
    if python_module_or_skip(test, "asyncpg", ASYNCPG_SPEC).is_none()
        || python_module_or_skip(test, "sqlalchemy", SQLALCHEMY_SPEC).is_none()
        || python_module_or_skip(test, "greenlet", SQLALCHEMY_SPEC).is_none()
    {
        return;
    }
    run_in_every_fence_mode("test_sqlalchemy.py", SQLALCHEMY_TESTS, try_run_python);
}
