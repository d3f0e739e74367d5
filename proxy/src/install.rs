//! `pgfence install`: creates or upgrades schema `pgfence` in an upstream database.

use pgfence_config::Config;
use tracing::info;

/// Installs (idempotently) the fence schema into `database`, connecting as `user`.
pub async fn install(
    config: &Config,
    database: &str,
    user: &str,
    password: Option<&str>,
    grant_to: Option<&str>,
) -> Result<(), String> {
    let mut pg = tokio_postgres::Config::new();
    pg.host(&config.upstream.host)
        .port(config.upstream.port)
        .dbname(database)
        .user(user);
    pg.application_name("pgfence install");
    if let Some(p) = password {
        pg.password(p);
    }
    let upstream = config.upstream.to_string();
    let (client, connection) = pg.connect(tokio_postgres::NoTls).await.map_err(|e| {
        format!("cannot connect to {upstream} (database {database:?}, user {user:?}): {e}")
    })?;
    let task = tokio::spawn(connection);
    let grant = grant_to.or(config.fence.grant_to.as_deref());
    let sql = fence_core::sql::install_sql(grant);
    client.batch_execute(&sql).await.map_err(|e| {
        let detail = e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_else(|| e.to_string());
        format!("installing schema pgfence into database {database:?} failed: {detail}")
    })?;
    drop(client);
    let _ = task.await;
    info!(database, upstream = %upstream, version = fence_core::sql::SCHEMA_VERSION, "schema pgfence installed");
    Ok(())
}
