//! psql and pgbench, the PostgreSQL project's own clients, through pgfence.
//!
//! - [`psql_script_same_output_direct_and_through_pgfence`]: one scripted psql session
//!   (multi-statement work, `\copy` from a file, from inline data, to a file and to stdout,
//!   an error mid-transaction then ROLLBACK, `\gset`, `\if`, `\gx`, `\crosstabview`,
//!   AUTOCOMMIT off, ON_ERROR_ROLLBACK's implicit savepoints, `\d`, notices, LISTEN/NOTIFY,
//!   large objects with `\lo_import`/`\lo_export` (libpq's FunctionCall messages), PREPARE /
//!   EXECUTE) run against three copies of one cluster: directly, through pgfence with the
//!   fence on, and with it off. stdout, stderr, the exit status and the files written must
//!   be the same (normalising only the temporary directory, and the server pid psql prints
//!   for a notification). Also `ON_ERROR_STOP=1` stops with exit status 3 both ways.
//! - [`pgbench_modes_through_pgfence`]: `pgbench -i` through pgfence, then `-S` (select
//!   only) and TPC-B in `-M simple`, `extended` and `prepared`, each through pgfence and
//!   directly on the same cluster: exit 0, every transaction processed, none failed, and the
//!   TPC-B books balance (accounts, tellers and branches each sum to the history's deltas;
//!   the history holds one row per transaction). Prints the tps figures of both.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use harness::{run_command, PgCluster, Proxy, APP_DB};

const PSQL_TIMEOUT: Duration = Duration::from_secs(60);
const PGBENCH_TIMEOUT: Duration = Duration::from_secs(120);

fn start_cluster() -> PgCluster {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster
}

/// The psql script; `{dir}` is replaced by a directory for its files.
const SCRIPT: &str = r#"\pset pager off
SELECT 1 AS one, 'two' AS two, NULL AS three;
CREATE TABLE items (id int PRIMARY KEY, name text, price numeric(10,2));
INSERT INTO items VALUES (1, 'apple', 1.50), (2, 'pear', 2.25);
INSERT INTO items SELECT g, 'item ' || g, g * 0.5 FROM generate_series(3, 20) g; SELECT count(*), sum(price) FROM items;
\copy items FROM '{dir}/in.csv' WITH (FORMAT csv)
\copy items (id, name) FROM stdin
100	inline one
101	inline two
\.
\copy (SELECT * FROM items ORDER BY id) TO '{dir}/out.csv' WITH (FORMAT csv, HEADER)
\copy (SELECT id, name FROM items WHERE id < 5 ORDER BY id) TO stdout
BEGIN;
UPDATE items SET price = price + 1 WHERE id = 1;
SELECT 1/0;
UPDATE items SET price = price + 1 WHERE id = 2;
ROLLBACK;
SELECT id, price FROM items WHERE id IN (1, 2) ORDER BY id;
SELECT max(id) AS max_id, count(*) AS n FROM items \gset
\echo max id :max_id, :n rows
SELECT :max_id + 1 AS next_id;
SELECT name FROM items WHERE id = :max_id \gset item_
\echo :item_name
\if :{?n}
\echo there are rows
\else
\echo no rows
\endif
SELECT id, name FROM items ORDER BY id LIMIT 2 \gx
SELECT v, h, sum(id) FROM (VALUES ('a', 'x', 1), ('a', 'y', 2), ('b', 'x', 3)) t(v, h, id) GROUP BY 1, 2 ORDER BY 1, 2 \crosstabview
\set AUTOCOMMIT off
INSERT INTO items VALUES (200, 'uncommitted', 0);
ROLLBACK;
INSERT INTO items VALUES (201, 'committed', 0);
COMMIT;
\set AUTOCOMMIT on
\set ON_ERROR_ROLLBACK on
BEGIN;
INSERT INTO items VALUES (300, 'kept', 0);
INSERT INTO items VALUES (300, 'duplicate', 0);
INSERT INTO items VALUES (301, 'also kept', 0);
COMMIT;
\set ON_ERROR_ROLLBACK off
SELECT id, name FROM items WHERE id >= 200 ORDER BY id;
\d items
DO $$ BEGIN RAISE NOTICE 'notice from DO'; UPDATE items SET price = 9 WHERE id = 3; END $$;
LISTEN psql_ch;
NOTIFY psql_ch, 'hello';
SELECT 'after notify';
\lo_import '{dir}/in.csv'
SELECT count(*) AS large_objects FROM pg_largeobject_metadata;
\lo_export :LASTOID '{dir}/lo.csv'
\lo_unlink :LASTOID
PREPARE by_id(int) AS SELECT name FROM items WHERE id = $1;
EXECUTE by_id(1);
DEALLOCATE by_id;
SELECT '\xff'::bytea AS b, E'tab\there' AS t;
SELECT nope FROM items;
SELECT count(*), sum(price) FROM items;
\echo done
"#;

/// What one psql run left behind, normalised.
#[derive(Debug, PartialEq, Eq)]
struct PsqlRun {
    status: String,
    stdout: String,
    stderr: String,
    out_csv: String,
    lo_csv: String,
}

fn normalise(text: &str, dir: &Path) -> String {
    let text = text.replace(&dir.display().to_string(), "{dir}");
    // psql names the server process that sent a notification.
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match line.find("server process with PID ") {
            Some(i) => {
                out.push_str(&line[..i]);
                out.push_str("server process with PID <pid>.");
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn run_psql_script(mut cmd: Command, script: &Path, dir: &Path, stop_on_error: bool) -> PsqlRun {
    cmd.args(["-a", "-d", APP_DB, "-f"]).arg(script);
    cmd.args([
        "-v",
        if stop_on_error {
            "ON_ERROR_STOP=1"
        } else {
            "ON_ERROR_STOP=0"
        },
    ]);
    let out = run_command(&mut cmd, None, PSQL_TIMEOUT);
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    PsqlRun {
        status: out.describe(),
        stdout: normalise(&out.stdout, dir),
        stderr: normalise(&out.stderr, dir),
        out_csv: read("out.csv"),
        lo_csv: read("lo.csv"),
    }
}

#[test]
fn psql_script_same_output_direct_and_through_pgfence() {
    let direct = start_cluster();
    let fenced = start_cluster();
    let plain = start_cluster();
    let fenced_proxy = Proxy::for_cluster(&fenced);
    let mut config = Proxy::config_for(&plain);
    config.fence.enabled = false;
    let plain_proxy = Proxy::start(config);

    let dirs: Vec<tempfile::TempDir> = (0..3)
        .map(|_| {
            let d = tempfile::tempdir().expect("a temporary directory");
            let csv: String = (1000..1100)
                .map(|i| format!("{i},\"csv, row {i}\",{i}.25\n"))
                .collect();
            std::fs::write(d.path().join("in.csv"), csv).unwrap();
            std::fs::write(d.path().join("script.sql"), SCRIPT).unwrap();
            d
        })
        .collect();
    let targets = [
        ("direct", direct.psql_cmd()),
        ("fence on", fenced_proxy.psql_cmd()),
        ("fence off", plain_proxy.psql_cmd()),
    ];
    let mut runs = Vec::new();
    for ((mode, cmd), dir) in targets.into_iter().zip(&dirs) {
        let script = SCRIPT.replace("{dir}", &dir.path().display().to_string());
        let path = dir.path().join("script.sql");
        std::fs::write(&path, script).unwrap();
        runs.push((mode, run_psql_script(cmd, &path, dir.path(), false)));
    }
    let (_, expected) = &runs[0];
    // The script itself must have done what it says, directly.
    assert_eq!(expected.status, "exit status: 0", "{expected:#?}");
    for needle in [
        "max id 1099, 122 rows",
        "there are rows",
        "NOTICE:  notice from DO",
        "Asynchronous notification \"psql_ch\" with payload \"hello\" received",
        "done",
    ] {
        assert!(
            expected.stdout.contains(needle) || expected.stderr.contains(needle),
            "direct run lacks {needle:?}:\n{}\n{}",
            expected.stdout,
            expected.stderr
        );
    }
    assert!(expected.stderr.contains("ERROR:  division by zero"));
    assert!(expected.stderr.contains("column \"nope\" does not exist"));
    assert_eq!(expected.out_csv.lines().count(), 123, "header and 122 rows");
    assert!(expected
        .lo_csv
        .starts_with("1000,\"csv, row 1000\",1000.25\n"));
    for (mode, run) in &runs[1..] {
        for (what, want, got) in [
            ("status", &expected.status, &run.status),
            ("stdout", &expected.stdout, &run.stdout),
            ("stderr", &expected.stderr, &run.stderr),
            ("out.csv", &expected.out_csv, &run.out_csv),
            ("lo.csv", &expected.lo_csv, &run.lo_csv),
        ] {
            if want != got {
                let diff: Vec<String> = want
                    .lines()
                    .zip(got.lines())
                    .filter(|(a, b)| a != b)
                    .take(10)
                    .map(|(a, b)| format!("  direct: {a}\n  {mode}: {b}"))
                    .collect();
                panic!(
                    "{mode}: psql {what} differs from direct ({} vs {} lines):\n{}\n--- {mode} ---\n{got}",
                    want.lines().count(),
                    got.lines().count(),
                    diff.join("\n")
                );
            }
        }
    }

    // ON_ERROR_STOP=1: psql stops at the first error with exit status 3, both ways.
    let stop = "SELECT 1;\nSELECT 1/0;\nSELECT 'not reached';\n";
    for (cmd, dir) in [
        (direct.psql_cmd(), &dirs[0]),
        (fenced_proxy.psql_cmd(), &dirs[1]),
    ] {
        let path = dir.path().join("stop.sql");
        std::fs::write(&path, stop).unwrap();
        let run = run_psql_script(cmd, &path, dir.path(), true);
        assert_eq!(run.status, "exit status: 3", "{run:#?}");
        assert!(!run.stdout.contains("not reached"), "{run:#?}");
    }
}

/// The numbers pgbench printed.
#[derive(Debug)]
struct Bench {
    processed: u64,
    failed: u64,
    tps: f64,
}

fn pgbench(mut cmd: Command, args: &[&str]) -> Bench {
    cmd.args(args).arg(APP_DB);
    let out = run_command(&mut cmd, None, PGBENCH_TIMEOUT);
    assert!(
        out.success(),
        "pgbench {args:?} failed ({}):\n{}\n{}",
        out.describe(),
        out.stdout,
        out.stderr
    );
    let field = |prefix: &str| {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in pgbench's output:\n{}", out.stdout))
            .trim()
            .to_string()
    };
    let processed = field("number of transactions actually processed: ");
    let (done, planned) = processed.split_once('/').expect("n/m");
    assert_eq!(done, planned, "pgbench {args:?}: {processed}");
    let failed = field("number of failed transactions: ");
    let tps = field("tps = ");
    Bench {
        processed: done.parse().unwrap(),
        failed: failed.split(' ').next().unwrap().parse().unwrap(),
        tps: tps.split(' ').next().unwrap().parse().unwrap(),
    }
}

/// The TPC-B books balance: every table's balances sum to the history's deltas.
fn assert_books_balance(cluster: &PgCluster, history_rows: u64) {
    let out = cluster.psql(
        APP_DB,
        "SELECT (SELECT sum(abalance) FROM pgbench_accounts), \
                (SELECT sum(tbalance) FROM pgbench_tellers), \
                (SELECT sum(bbalance) FROM pgbench_branches), \
                (SELECT coalesce(sum(delta), 0) FROM pgbench_history), \
                (SELECT count(*) FROM pgbench_history)",
    );
    let v: Vec<&str> = out.trim().split('|').collect();
    assert_eq!(v.len(), 5, "{out}");
    assert_eq!(v[0], v[3], "sum(abalance) vs sum(delta): {out}");
    assert_eq!(v[1], v[3], "sum(tbalance) vs sum(delta): {out}");
    assert_eq!(v[2], v[3], "sum(bbalance) vs sum(delta): {out}");
    assert_eq!(v[4], history_rows.to_string(), "history rows: {out}");
}

#[test]
fn pgbench_modes_through_pgfence() {
    let cluster = start_cluster();
    let proxy = Proxy::for_cluster(&cluster);
    let init = {
        let mut cmd = cluster.pgbench_cmd();
        // pgbench_cmd points at the cluster: send it through the proxy instead.
        cmd.args(["-p", &proxy.port().to_string()]);
        cmd
    };
    let mut cmd = init;
    cmd.args(["-i", "-s", "1", "-q"]).arg(APP_DB);
    let out = run_command(&mut cmd, None, PGBENCH_TIMEOUT);
    assert!(out.success(), "pgbench -i: {}\n{}", out.stdout, out.stderr);
    let accounts = cluster.psql(APP_DB, "SELECT count(*) FROM pgbench_accounts");
    assert_eq!(accounts.trim(), "100000");
    assert_books_balance(&cluster, 0);

    let through = || {
        let mut cmd = cluster.pgbench_cmd();
        cmd.args(["-p", &proxy.port().to_string()]);
        cmd
    };
    let mut history = 0;
    let mut report = Vec::new();
    for mode in ["simple", "extended", "prepared"] {
        for (script, extra) in [("select-only", &["-S"][..]), ("tpcb", &[][..])] {
            let mut figures = Vec::new();
            for (path, cmd) in [("direct", cluster.pgbench_cmd()), ("pgfence", through())] {
                let mut args = vec!["-n", "-c", "4", "-j", "2", "-t", "200", "-M", mode];
                args.extend_from_slice(extra);
                let bench = pgbench(cmd, &args);
                assert_eq!(bench.processed, 800, "{path} {mode} {script}");
                assert_eq!(bench.failed, 0, "{path} {mode} {script}");
                if script == "tpcb" {
                    history += 800;
                    assert_books_balance(&cluster, history);
                }
                figures.push(bench.tps);
            }
            report.push(format!(
                "{script:>11} -M {mode:<8}  direct {:>8.0} tps   pgfence {:>8.0} tps",
                figures[0], figures[1]
            ));
        }
    }
    eprintln!(
        "pgbench -c 4 -j 2 -t 200, scale 1, fence on:\n{}",
        report.join("\n")
    );
}
