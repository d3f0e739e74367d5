//! `pgfence install`: creates or upgrades schema `pgfence` in an upstream database.
//!
//! A fresh install, or a database whose schema already uses advisory accept locks, gets the
//! current schema in one transaction. An upgrade from a schema that locked accepted fences
//! with `FOR SHARE` (versions before 4) goes in two steps, because that schema's advancers
//! take no advisory lock: a transaction still running the old functions could advance a
//! fence without waiting for transactions accepted under an advisory lock alone. So the
//! upgrade first installs the current functions with row accept locks (compatible with both),
//! waits until every transaction that was running at that moment has ended, and only then
//! switches to advisory accept locks. If some transaction outlives the wait, the schema
//! stays on row locks (safe, slower) and the next `pgfence install` finishes the switch.

use std::time::{Duration, Instant};

use fence_core::sql::{install_sql_with, AcceptLock, SCHEMA_VERSION};
use pgfence_config::Config;
use tokio_postgres::Client;
use tracing::{info, warn};

/// How long an upgrade waits for transactions that may still run the old functions.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the wait looks again.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Installs (idempotently) the fence schema into `database`, connecting as `user`.
pub async fn install(
    config: &Config,
    database: &str,
    user: &str,
    password: Option<&str>,
    grant_to: Option<&str>,
) -> Result<(), String> {
    install_with(config, database, user, password, grant_to, DRAIN_TIMEOUT).await
}

/// [`install`], waiting at most `drain` for old transactions during an upgrade.
pub async fn install_with(
    config: &Config,
    database: &str,
    user: &str,
    password: Option<&str>,
    grant_to: Option<&str>,
    drain: Duration,
) -> Result<(), String> {
    let mut pg = tokio_postgres::Config::new();
    pg.dbname(database).user(user);
    pg.application_name("pgfence install");
    if let Some(p) = password {
        pg.password(p);
    }
    let upstream = config.upstream.to_string();
    // pgfence's own connection (TCP or socket, TLS as `upstream.sslmode` says), over which
    // tokio-postgres speaks the protocol.
    let tls = crate::tls::connector(&config.upstream)?;
    let stream = crate::net::Stream::connect(&config.upstream, tls, &config.limits)
        .await
        .map_err(|e| format!("cannot connect to {upstream}: {e}"))?;
    let (client, connection) = pg
        .connect_raw(stream, tokio_postgres::NoTls)
        .await
        .map_err(|e| {
            format!(
                "cannot connect to {upstream} (database {database:?}, user {user:?}): {}",
                describe(&e)
            )
        })?;
    let task = tokio::spawn(connection);
    let grant = grant_to.or(config.fence.grant_to.as_deref());
    let failed = |e: tokio_postgres::Error| {
        format!(
            "installing schema pgfence into database {database:?} failed: {}",
            describe(&e)
        )
    };
    let accept = if row_locks_may_be_in_use(&client).await.map_err(failed)? {
        client
            .batch_execute(&install_sql_with(grant, AcceptLock::Row))
            .await
            .map_err(failed)?;
        info!(
            database,
            "schema pgfence upgraded with row accept locks; waiting for the transactions in \
             flight to end before switching to advisory accept locks"
        );
        match wait_for_transactions_in_flight(&client, drain)
            .await
            .map_err(failed)?
        {
            0 => {
                client
                    .batch_execute(&install_sql_with(grant, AcceptLock::Advisory))
                    .await
                    .map_err(failed)?;
                AcceptLock::Advisory
            }
            left => {
                warn!(
                    database,
                    transactions = left,
                    waited_secs = drain.as_secs(),
                    "schema pgfence keeps row accept locks (correct, slower): transactions \
                     older than the upgrade are still open; run `pgfence install` again \
                     once they have ended"
                );
                AcceptLock::Row
            }
        }
    } else {
        client
            .batch_execute(&install_sql_with(grant, AcceptLock::Advisory))
            .await
            .map_err(failed)?;
        AcceptLock::Advisory
    };
    if config.fence.skip_read_only {
        report_read_audit(&client, config, database).await;
    }
    drop(client);
    let _ = task.await;
    info!(
        database,
        upstream = %upstream,
        version = SCHEMA_VERSION,
        accept_lock = accept.as_str(),
        "schema pgfence installed"
    );
    Ok(())
}

/// Says what the schema's read audit found in `database` (`pgfence.read_audit_objects()`,
/// the first ten objects) while `fence.skip_read_only` is on: with `fence.read_audit` every
/// transaction there is checked, reads too; without it a read that writes through one of
/// them commits unchecked. Also warns when the event trigger that keeps the verdict could
/// not be created (it takes a superuser). A failed look is only logged: the install itself
/// succeeded.
async fn report_read_audit(client: &Client, config: &Config, database: &str) {
    let looked = async {
        let objects = client
            .query("SELECT o FROM pgfence.read_audit_objects() AS o", &[])
            .await?;
        let kept = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger \
                 WHERE evtname = 'pgfence_read_audit')",
                &[],
            )
            .await?;
        Ok::<_, tokio_postgres::Error>((objects, kept.get::<_, bool>(0)))
    };
    let (objects, kept) = match looked.await {
        Ok(found) => found,
        Err(e) => {
            warn!(
                database,
                error = %describe(&e),
                "could not look for objects through which reads may write"
            );
            return;
        }
    };
    if !objects.is_empty() {
        let found: Vec<String> = objects.iter().take(10).map(|r| r.get(0)).collect();
        if config.fence.read_audit {
            warn!(
                database,
                objects = objects.len(),
                first = %found.join("; "),
                "reads may call this database's own functions through these objects, so \
                 pgfence checks every transaction here, reads too (each pays the check); if \
                 none of their functions writes, fence.read_audit = false skips reads again \
                 (README, \"Reads that write through the schema\")"
            );
        } else {
            warn!(
                database,
                objects = objects.len(),
                first = %found.join("; "),
                "reads may call this database's own functions through these objects: with \
                 fence.read_audit = false a read that writes through one is not checked, and \
                 a stale write commits; set fence.read_audit = true unless none of their \
                 functions writes (README, \"Reads that write through the schema\")"
            );
        }
    }
    if !kept && config.fence.read_audit {
        warn!(
            database,
            "the event trigger pgfence_read_audit was not created (it takes a superuser): \
             sessions audit the catalog instead (milliseconds to tens of milliseconds of \
             server time, at most once a second per database and pgfence, see README); run \
             `pgfence install` as a superuser to keep the verdict instead"
        );
    }
}

/// What went wrong, in the server's words when it answered with an error (tokio-postgres
/// itself only says "db error"), else with the causes behind the error ("invalid
/// configuration: password missing").
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = format!("{} {}: {}", db.severity(), db.code().code(), db.message());
        if let Some(detail) = db.detail() {
            text.push_str(&format!(" (DETAIL: {detail})"));
        }
        if let Some(hint) = db.hint() {
            text.push_str(&format!(" (HINT: {hint})"));
        }
        return text;
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// Whether an installed schema may still have transactions accepting fences under row locks
/// alone: one before version 4, or one left on row accept locks by an earlier upgrade.
async fn row_locks_may_be_in_use(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT pg_catalog.to_regclass('pgfence.schema_version') IS NOT NULL",
            &[],
        )
        .await?;
    if !row.get::<_, bool>(0) {
        return Ok(false);
    }
    // to_jsonb: the column does not exist before version 4.
    let row = client
        .query_opt(
            "SELECT v.version, pg_catalog.to_jsonb(v) ->> 'accept_lock' \
             FROM pgfence.schema_version AS v",
            &[],
        )
        .await?;
    Ok(match row {
        None => false,
        Some(row) => {
            let version: i32 = row.get(0);
            let lock: Option<String> = row.get(1);
            version < 4 || lock.as_deref() != Some(AcceptLock::Advisory.as_str())
        }
    })
}

/// Waits until every transaction that is running now (of any session but this one, with or
/// without a transaction id: a forced check may advance a fence from a transaction that had
/// not written yet) has ended, or `limit` passed; returns how many are still running.
async fn wait_for_transactions_in_flight(
    client: &Client,
    limit: Duration,
) -> Result<i64, tokio_postgres::Error> {
    // Every transaction holds the lock on its own virtual transaction id until it ends
    // (what CREATE INDEX CONCURRENTLY waits on, too).
    let rows = client
        .query(
            "SELECT l.virtualxid FROM pg_catalog.pg_locks AS l \
             WHERE l.locktype = 'virtualxid' AND l.pid <> pg_catalog.pg_backend_pid()",
            &[],
        )
        .await?;
    let vxids: Vec<String> = rows.iter().filter_map(|r| r.get(0)).collect();
    let still = client
        .prepare(
            "SELECT count(*) FROM pg_catalog.pg_locks AS l \
             WHERE l.locktype = 'virtualxid' AND l.virtualxid = ANY ($1::text[])",
        )
        .await?;
    let until = Instant::now() + limit;
    loop {
        let left: i64 = client.query_one(&still, &[&vxids]).await?.get(0);
        if left == 0 || Instant::now() >= until {
            return Ok(left);
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}
