//! psycopg 3 through pgfence: `tests/python/test_smoke.py` and `tests/python/test_protocol.py`
//! run directly against PostgreSQL (which checks the scripts' own expectations), then through
//! pgfence with the fence on and with it off (PGFENCE_DSN). Every test of each script must
//! report `ok`.

use harness::{python_or_skip, run_python, PgCluster, Proxy, APP_DB};

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
