//! The real-PostgreSQL test harness for pgfence (crate `pgfence-tests`, lib `harness`).
//!
//! - [`PgCluster`]: a throwaway PostgreSQL server per test, with the roles `md5user` and
//!   `scramuser` and a database `app` (see [`cluster`] for the exact setup).
//! - [`Proxy`]: pgfence running in-process on its own tokio runtime, for sync and async tests.
//! - [`ProxyProcess`]: the real `pgfence` binary as a child process, for signals and logs.
//! - [`run_python`]: the psycopg and asyncpg scripts in `tests/python/`.
//! - [`try_run_node`]: the Node.js driver scripts in `tests/node/`.
//! - [`run_in_every_fence_mode`]: a driver script directly and through pgfence with the
//!   fence on (with and without the fast path) and off.
//! - [`tls`]: a CA and a server certificate made per test, and a blocking TLS client.
//! - [`wire`]: raw protocol frames and a blocking connection with deadlines, for byte-exact
//!   tests.
//! - [`checker`]: the fencing invariant of SPEC section 4, checked over what a server committed.
//! - [`fence`]: the exact FN001/FN002/FN003 texts, schema install and psql runs for the
//!   end-to-end fence tests.
//! - [`operating`]: JSON log events, `/metrics` scraped and parsed, config rewrites, for
//!   the tests of what operators see (SPEC section 7).
//!
//! Everything here panics with a message saying what failed: it is test code, and a panic
//! is how a test fails. Every server, proxy and directory is cleaned up on drop, also when
//! the test panics.
#![forbid(unsafe_code)]

pub mod checker;
mod client;
pub mod cluster;
mod drivers;
pub mod fence;
mod host;
pub mod node;
pub mod operating;
mod ports;
mod process;
pub mod proxy;
pub mod proxy_process;
pub mod python;
pub mod tls;
pub mod wire;

pub use client::{connect_to, psql_conninfo, quote_conn_value, try_connect_to, wait_for_none};
pub use cluster::{
    pg_bin_dir, PgCluster, PgClusterBuilder, APP_DB, MD5_PASSWORD, MD5_USER, SCRAM_PASSWORD,
    SCRAM_USER, SUPERUSER,
};
pub use drivers::{run_in_every_fence_mode, ScriptRunner};
pub use nix::sys::signal::Signal;
pub use node::{node, node_dir, node_or_skip, try_run_node};
pub use ports::free_port;
pub use process::{run as run_command, Outcome};
pub use proxy::{init_tracing, Proxy};
pub use proxy_process::{ProxyProcess, ProxyProcessBuilder};
pub use python::{
    in_ci, python, python_dir, python_has_module, python_module_or_skip, python_or_skip,
    run_python, try_run_python,
};

/// The address every server and proxy of the harness listens on.
pub const HOST: &str = "127.0.0.1";
