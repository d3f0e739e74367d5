//! Helpers of the end-to-end fence tests (`tests/tests/fence_*.rs`): installing schema
//! `pgfence`, the exact FN001/FN002/FN003 texts a client must see (SPEC section 5), asserting
//! them on tokio-postgres errors, connections that keep their notices, and psql runs that are
//! allowed to fail.
//!
//! The texts are written out here rather than taken from fence-core, so that a change of
//! wording in pgfence fails a test instead of silently changing what users see.

use std::process::Command;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_postgres::error::DbError;
use tokio_postgres::{AsyncMessage, Client, NoTls};

use crate::process;

/// DETAIL of every FN003.
pub const INVALID_DETAIL: &str = "This transaction was rolled back.";
/// HINT of FN003 for malformed tokens and resources.
pub const INVALID_HINT: &str = "Fencing tokens are integers from 0 to 9223372036854775807; \
                                resources are 1 to 63 characters from [A-Za-z0-9_.:-].";
/// HINT of FN003 for two tokens in one transaction.
pub const CONFLICT_HINT: &str = "A transaction belongs to one leader: use one token per resource.";
/// HINT of FN002.
pub const MISSING_HINT: &str = "Set fencing.token (options=-c fencing.token=N, or SET \
                                fencing.token = N), or add /* fencing_token=N */ to a statement \
                                of the transaction.";

/// What a client must see for one rejection: SQLSTATE, message, detail and hint, severity
/// `ERROR`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub code: &'static str,
    pub message: String,
    pub detail: String,
    pub hint: String,
}

/// FN001 for `token` on `resource` whose fence is `fence`.
pub fn stale(resource: &str, token: i64, fence: i64) -> Expected {
    Expected {
        code: "FN001",
        message: format!(
            "stale fencing token {token} for resource \"{resource}\": token {fence} was already \
             accepted"
        ),
        detail: format!(
            "A newer holder of the lease on \"{resource}\" has written with token {fence}. This \
             transaction was rolled back and none of its writes were applied."
        ),
        hint: format!(
            "This client is no longer the leader for \"{resource}\": stop writing, and \
             re-acquire the lease to get a new token."
        ),
    }
}

/// FN002 for `resource`.
pub fn missing(resource: &str) -> Expected {
    Expected {
        code: "FN002",
        message: format!(
            "missing fencing token for resource \"{resource}\": the transaction wrote without a \
             token"
        ),
        detail: format!(
            "Resource \"{resource}\" requires a fencing token on every write transaction. This \
             transaction was rolled back."
        ),
        hint: MISSING_HINT.to_string(),
    }
}

/// FN003 for a malformed token (`shown` as the message quotes it) on `resource`.
pub fn invalid_token(resource: &str, shown: &str) -> Expected {
    Expected {
        code: "FN003",
        message: format!(
            "invalid fencing token \"{shown}\" for resource \"{resource}\": expected an integer \
             from 0 to 9223372036854775807"
        ),
        detail: INVALID_DETAIL.to_string(),
        hint: INVALID_HINT.to_string(),
    }
}

/// FN003 for a malformed resource name.
pub fn invalid_resource(shown: &str) -> Expected {
    Expected {
        code: "FN003",
        message: format!(
            "invalid fencing resource \"{shown}\": expected 1 to 63 characters from \
             [A-Za-z0-9_.:-]"
        ),
        detail: INVALID_DETAIL.to_string(),
        hint: INVALID_HINT.to_string(),
    }
}

/// FN003 for two different tokens `a` and `b` (in the order the message names them) for
/// `resource` in one transaction.
pub fn conflicting(resource: &str, a: &str, b: &str) -> Expected {
    Expected {
        code: "FN003",
        message: format!(
            "conflicting fencing tokens {a} and {b} for resource \"{resource}\" in one \
             transaction"
        ),
        detail: INVALID_DETAIL.to_string(),
        hint: CONFLICT_HINT.to_string(),
    }
}

/// The server error inside `err`; panics (with `context`) when it is not one.
pub fn db_error<'a>(err: &'a tokio_postgres::Error, context: &str) -> &'a DbError {
    err.as_db_error()
        .unwrap_or_else(|| panic!("{context}: not a server error: {err:?}"))
}

/// The SQLSTATE of a result's error, `None` for success or a non-server error.
pub fn sqlstate<T>(result: &Result<T, tokio_postgres::Error>) -> Option<String> {
    result
        .as_ref()
        .err()
        .and_then(|e| e.as_db_error())
        .map(|e| e.code().code().to_string())
}

/// Asserts that `err` is exactly the rejection `expected`: SQLSTATE, severity `ERROR` (never
/// FATAL: the session stays usable), message, detail, hint, and no PL/pgSQL context of
/// pgfence's functions.
pub fn assert_rejection(err: &tokio_postgres::Error, expected: &Expected, context: &str) {
    let e = db_error(err, context);
    assert_eq!(e.code().code(), expected.code, "{context}: {e:?}");
    assert_eq!(e.severity(), "ERROR", "{context}: {e:?}");
    assert_eq!(e.message(), expected.message, "{context}");
    assert_eq!(e.detail(), Some(expected.detail.as_str()), "{context}");
    assert_eq!(e.hint(), Some(expected.hint.as_str()), "{context}");
    assert_eq!(e.where_(), None, "{context}: pgfence's call stack leaked");
}

/// [`assert_rejection`] on a result that must have failed.
pub fn assert_rejected<T: std::fmt::Debug>(
    result: &Result<T, tokio_postgres::Error>,
    expected: &Expected,
    context: &str,
) {
    match result {
        Ok(v) => panic!("{context}: expected {}, got success {v:?}", expected.code),
        Err(e) => assert_rejection(e, expected, context),
    }
}

/// Installs (or re-installs, idempotently) schema `pgfence`, EXECUTE granted to PUBLIC.
pub async fn install(client: &Client) {
    client
        .batch_execute(&fence_core::sql::install_sql(None))
        .await
        .expect("install schema pgfence");
}

/// A tokio-postgres client whose notices and warnings (e.g. `there is no transaction in
/// progress`) arrive on the returned channel. Must be called inside a tokio runtime.
pub async fn connect_with_notices(connstr: &str) -> (Client, mpsc::UnboundedReceiver<DbError>) {
    let (client, mut connection) = tokio_postgres::connect(connstr, NoTls)
        .await
        .unwrap_or_else(|e| panic!("could not connect with `{connstr}`: {e:?}"));
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = futures_util::StreamExt::next(&mut messages).await {
            match message {
                Ok(AsyncMessage::Notice(notice)) => {
                    let _ = tx.send(notice);
                }
                Ok(_) => {}
                Err(e) => {
                    eprintln!("harness: connection closed with an error: {e}");
                    break;
                }
            }
        }
    });
    (client, rx)
}

/// Drains the notices received so far, as SQLSTATEs.
pub fn drain_notices(rx: &mut mpsc::UnboundedReceiver<DbError>) -> Vec<String> {
    let mut codes = Vec::new();
    while let Ok(n) = rx.try_recv() {
        codes.push(n.code().code().to_string());
    }
    codes
}

/// What a psql run printed.
#[derive(Debug)]
pub struct PsqlRun {
    /// True when psql exited by itself with status 0.
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `sql` through `cmd` (a psql command, e.g. [`crate::Proxy::psql_cmd`]) on `db` with
/// `-X -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose`, so errors are printed with their
/// SQLSTATE, DETAIL and HINT and do not stop the script. Never panics on SQL errors.
pub fn psql_script(mut cmd: Command, db: &str, sql: &str) -> PsqlRun {
    cmd.args(["-At", "-v", "ON_ERROR_STOP=0", "-v", "VERBOSITY=verbose"])
        .args(["-d", db, "-f", "-"]);
    let out = process::run(&mut cmd, Some(sql.as_bytes()), Duration::from_secs(60));
    PsqlRun {
        success: out.success(),
        stdout: out.stdout,
        stderr: out.stderr,
    }
}

/// The lines psql prints for `expected` with `VERBOSITY=verbose` (each line without psql's
/// `psql:<file>:<line>: ` prefix): `ERROR:  CODE: message`, `DETAIL:  ...`, `HINT:  ...`.
pub fn psql_error_lines(expected: &Expected) -> [String; 3] {
    [
        format!("ERROR:  {}: {}", expected.code, expected.message),
        format!("DETAIL:  {}", expected.detail),
        format!("HINT:  {}", expected.hint),
    ]
}

/// Asserts that psql's stderr holds `expected` as consecutive lines, exactly once.
pub fn assert_psql_rejection(stderr: &str, expected: &Expected, context: &str) {
    let lines: Vec<&str> = stderr.lines().collect();
    let [error, detail, hint] = psql_error_lines(expected);
    let found = lines
        .windows(3)
        .filter(|w| w[0].ends_with(&error) && w[1] == detail && w[2] == hint)
        .count();
    assert_eq!(
        found, 1,
        "{context}: expected once in psql's stderr:\n{error}\n{detail}\n{hint}\n--- stderr ---\n{stderr}"
    );
}

/// Runs `pg_sleep(30)` on `client`, cancels it with a CancelRequest carrying the key the
/// client was given (through whatever `client` is connected to), expects 57014 and hands
/// the client back.
pub async fn cancelled_sleep(client: Client) -> Client {
    let cancel = client.cancel_token();
    let sleeper = tokio::spawn(async move {
        let r = client.batch_execute("SELECT pg_sleep(30)").await;
        (client, r)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cancel.cancel_query(NoTls).await.unwrap();
    let (client, r) = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancelled pg_sleep returns")
        .unwrap();
    assert_eq!(sqlstate(&r).as_deref(), Some("57014"), "{r:?}");
    client
}
