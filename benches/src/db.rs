//! The runner's own connections (tokio-postgres on a current-thread runtime): setup
//! queries against PostgreSQL directly, and the clients of the stale-writer and
//! idle-session measurements.

use std::time::Duration;

use tokio::runtime::Runtime;
use tokio_postgres::{Client, NoTls};

use crate::error::{Error, Result};

/// Connection parameters shared by every connection of the run.
#[derive(Debug, Clone)]
pub struct Login {
    pub user: String,
    pub database: String,
    /// PGPASSWORD, when set.
    pub password: Option<String>,
}

impl Login {
    /// The user and database of the run; the password from PGPASSWORD.
    pub fn new(user: &str, database: &str) -> Login {
        Login {
            user: user.to_string(),
            database: database.to_string(),
            password: std::env::var("PGPASSWORD").ok(),
        }
    }
}

/// The runtime the runner's connections live on. Their connection tasks make progress only
/// inside [`Db::block_on`], which is where every query runs.
#[derive(Debug)]
pub struct Db {
    rt: Runtime,
    pub login: Login,
}

impl Db {
    /// A current-thread runtime.
    pub fn new(login: Login) -> Result<Db> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Spawn {
                program: "a tokio runtime".to_string(),
                source,
            })?;
        Ok(Db { rt, login })
    }

    /// Runs `f` on the runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// Connects to `host:port` with startup `options` (when given). Call inside
    /// [`Db::block_on`].
    pub async fn connect(&self, host: &str, port: u16, options: Option<&str>) -> Result<Client> {
        let mut config = tokio_postgres::Config::new();
        config
            .host(host)
            .port(port)
            .user(&self.login.user)
            .dbname(&self.login.database)
            .application_name("pgfence-bench")
            .connect_timeout(Duration::from_secs(10));
        if let Some(p) = &self.login.password {
            config.password(p);
        }
        if let Some(o) = options {
            config.options(o);
        }
        let (client, connection) = config
            .connect(NoTls)
            .await
            .map_err(Error::pg(format!("connecting to {host}:{port}")))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// Runs `sql` (simple protocol, any number of statements) on a fresh connection.
    pub fn execute(&self, host: &str, port: u16, sql: &str) -> Result<()> {
        self.block_on(async {
            let client = self.connect(host, port, None).await?;
            client
                .batch_execute(sql)
                .await
                .map_err(Error::pg(format!("running {sql:?}")))
        })
    }

    /// The first column of the first row of `sql`, as text (`None`: no row, or NULL).
    pub fn query_text(&self, host: &str, port: u16, sql: &str) -> Result<Option<String>> {
        self.block_on(async {
            let client = self.connect(host, port, None).await?;
            let messages = client
                .simple_query(sql)
                .await
                .map_err(Error::pg(format!("running {sql:?}")))?;
            Ok(messages.into_iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
                _ => None,
            }))
        })
    }
}
