//! The runner's error type: every variant says what went wrong and, where there is one,
//! what to do about it, because the person reading it is at a terminal, not in a debugger.

use std::path::PathBuf;
use std::time::Duration;

/// What stopped the runner (or one measurement).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A program the runner needs is not installed.
    #[error("{program} not found: {hint}")]
    MissingTool {
        program: &'static str,
        hint: &'static str,
    },
    /// A program could not be started at all.
    #[error("could not start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// A program ran and failed.
    #[error("{what} failed ({status})\n{output}{}", hint.map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Failed {
        what: String,
        status: String,
        /// The end of what it printed (stdout, stderr or its log).
        output: String,
        hint: Option<&'static str>,
    },
    /// A server process did not come up.
    #[error("{what} did not accept connections on port {port} within {waited:?}\n--- its log ---\n{log}")]
    NotReady {
        what: String,
        port: u16,
        waited: Duration,
        log: String,
    },
    /// A server process the runner started exited while it was still needed.
    #[error("{what} exited unexpectedly ({status})\n--- its log ---\n{log}")]
    Died {
        what: String,
        status: String,
        log: String,
    },
    /// A file or directory operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A query the runner sends itself (setup, stale writer, idle sessions) failed.
    #[error("{what}: {}", describe_pg(source))]
    Postgres {
        what: String,
        source: tokio_postgres::Error,
    },
    /// A program printed something the runner cannot read.
    #[error("could not read {what}: {detail}")]
    Parse { what: &'static str, detail: String },
    /// A command-line value that cannot work.
    #[error("{0}")]
    Usage(String),
    /// Ctrl-C, SIGTERM or SIGHUP.
    #[error("interrupted")]
    Interrupted,
}

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    }

    /// An [`Error::Postgres`] saying what the runner was doing.
    pub fn pg(what: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
        let what = what.into();
        move |source| Error::Postgres { what, source }
    }
}

/// tokio-postgres says only "db error" for a server error: show the server's message.
fn describe_pg(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{} {}: {}{}",
            db.severity(),
            db.code().code(),
            db.message(),
            db.hint()
                .map(|h| format!(" (hint: {h})"))
                .unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

/// The runner's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
