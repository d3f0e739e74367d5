//! The psycopg smoke script (`tests/python/test_smoke.py`) against PostgreSQL directly:
//! checks the python test infrastructure itself, and the script before it is pointed at
//! pgfence.

use harness::{python_or_skip, run_python, PgCluster, APP_DB};

#[test]
fn smoke_script_passes_against_postgresql() {
    if python_or_skip("smoke_script_passes_against_postgresql").is_none() {
        return;
    }
    let cluster = PgCluster::start();
    let dsn = cluster.connstr(APP_DB);
    let out = run_python("test_smoke.py", &[("PG_DIRECT_DSN", &dsn)]);
    for name in [
        "parameterized_query",
        "pipeline",
        "copy",
        "server_side_cursor",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("ok {name} "))),
            "no `ok {name}` in:\n{out}"
        );
    }
}
