//! Connection strings and tokio-postgres connections, shared by clusters and proxies.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use crate::cluster::SUPERUSER;
use crate::process;

/// Waits until `count_sql` (one `count(*)`, or any one bigint) returns 0 on `client`,
/// polling every 20 ms; panics after `within`, naming `what` is left.
pub async fn wait_for_none(client: &Client, count_sql: &str, within: Duration, what: &str) {
    let start = std::time::Instant::now();
    loop {
        let left: i64 = client
            .query_one(count_sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{count_sql}: {e}"))
            .get(0);
        if left == 0 {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{left} {what} left after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Deadline of one psql run.
const PSQL_TIMEOUT: Duration = Duration::from_secs(120);

/// Quotes a value for a libpq key=value connection string when it needs it.
pub fn quote_conn_value(value: &str) -> String {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\');
    if plain {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

/// The key=value connection string of the harness, understood by libpq, psycopg and
/// tokio-postgres alike.
pub(crate) fn connstr(port: u16, db: &str, user: &str, password: Option<&str>) -> String {
    let mut s = format!(
        "host={} port={port} user={} dbname={} connect_timeout=10",
        crate::HOST,
        quote_conn_value(user),
        quote_conn_value(db)
    );
    if let Some(password) = password {
        s.push_str(" password=");
        s.push_str(&quote_conn_value(password));
    }
    s
}

/// Runs `psql -X -At -v ON_ERROR_STOP=1 -c <sql>` against 127.0.0.1:`port` with `conninfo`
/// (more key=value pairs: user, dbname, TLS settings) and a libpq environment cleared of
/// anything that would change the connection. The outcome, failed or not.
pub fn psql_conninfo(port: u16, conninfo: &str, sql: &str) -> process::Outcome {
    let mut cmd = Command::new(crate::pg_bin_dir().join("psql"));
    cmd.args(["-X", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .arg(format!(
            "host={} port={port} connect_timeout=10 {conninfo}",
            crate::HOST
        ));
    for var in [
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGCHANNELBINDING",
        "PGOPTIONS",
        "PGPASSWORD",
        "PSQLRC",
    ] {
        cmd.env_remove(var);
    }
    process::run(&mut cmd, None, PSQL_TIMEOUT)
}

/// Connects with tokio-postgres, without TLS, and drives the connection on a spawned task.
/// Must be called inside a tokio runtime.
pub async fn try_connect_to(connstr: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(connstr, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("harness: connection closed with an error: {e}");
        }
    });
    Ok(client)
}

/// [`try_connect_to`], panicking with the connection string when it fails.
pub async fn connect_to(connstr: &str) -> Client {
    match try_connect_to(connstr).await {
        Ok(client) => client,
        Err(e) => panic!("could not connect with `{connstr}`: {e:?}"),
    }
}

/// `psql -X -h 127.0.0.1 -p <port> -U postgres` with a clean libpq environment.
pub(crate) fn psql_command(bin_dir: &Path, port: u16) -> Command {
    let mut cmd = client_command(&bin_dir.join("psql"), port);
    cmd.arg("-X");
    cmd
}

/// `<program> -h 127.0.0.1 -p <port> -U postgres` with a clean libpq environment.
pub(crate) fn client_command(program: &Path, port: u16) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(["-h", crate::HOST, "-p", &port.to_string(), "-U", SUPERUSER])
        .env("PGCONNECT_TIMEOUT", "10");
    for var in [
        "PGPASSWORD",
        "PGPASSFILE",
        "PGSERVICE",
        "PGOPTIONS",
        "PGSSLMODE",
        "PGDATABASE",
        "PGAPPNAME",
        "PSQLRC",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Runs `sql` through `cmd` (a psql command) on `db`; stdout, or a panic with stderr.
pub(crate) fn run_psql(mut cmd: Command, db: &str, sql: &str) -> String {
    cmd.args(["-Atq", "-v", "ON_ERROR_STOP=1", "-d", db, "-f", "-"]);
    let out = process::run(&mut cmd, Some(sql.as_bytes()), PSQL_TIMEOUT);
    if !out.success() {
        panic!(
            "psql failed ({}) on database {db}\n--- sql ---\n{sql}\n--- stderr ---\n{}--- stdout ---\n{}",
            out.describe(),
            out.stderr,
            out.stdout
        );
    }
    out.stdout
}
