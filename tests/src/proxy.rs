//! [`Proxy`]: pgfence running inside the test process.
//!
//! The proxy gets its own thread and multi-thread tokio runtime, so a sync test and an async
//! test (whatever its runtime flavour) use it the same way, and a test that blocks its own
//! runtime cannot starve the proxy. The listener is bound before [`Proxy::start`] returns:
//! clients can connect at once.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::mpsc;
use std::sync::{Arc, Once};
use std::thread;
use std::time::Duration;

use pgfence_config::Config;
use tokio::sync::oneshot;

use crate::client::{connect_to, connstr, psql_command, run_psql};
use crate::cluster::{pg_bin_dir, PgCluster, SUPERUSER};

/// How long sessions may drain at shutdown in configs made by [`Proxy::config_for`].
const TEST_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3);
/// Added to the config's shutdown timeout before drop gives up waiting for the proxy.
const JOIN_GRACE: Duration = Duration::from_secs(10);

/// Installs a tracing subscriber that writes through libtest's capture (shown for failing
/// tests), filtered by `RUST_LOG`, `warn` by default. Idempotent; [`Proxy::start`] calls it.
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

/// pgfence serving on 127.0.0.1 in this process. Shut down (and joined, with a deadline) on
/// drop.
pub struct Proxy {
    addr: SocketAddr,
    config: Arc<Config>,
    shutdown: Option<oneshot::Sender<()>>,
    done: mpsc::Receiver<io::Result<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Proxy {
    /// Binds 127.0.0.1:0, sets `config.listen` to that address and runs `pgfence::run` on
    /// a runtime of its own.
    pub fn start(mut config: Config) -> Proxy {
        init_tracing();
        let listener =
            std::net::TcpListener::bind((crate::HOST, 0)).expect("bind the proxy listener");
        listener
            .set_nonblocking(true)
            .expect("make the proxy listener non-blocking");
        let addr = listener
            .local_addr()
            .expect("local address of the proxy listener");
        config.listen = addr;
        let config = Arc::new(config);

        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        let run_config = Arc::clone(&config);
        let thread = thread::Builder::new()
            .name(format!("pgfence-proxy-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("pgfence-proxy-worker")
                    .enable_all()
                    .build()
                    .expect("build the proxy's tokio runtime");
                let result = runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    // A dropped sender (the Proxy leaked or its thread gone) also shuts down.
                    let shutdown = async move {
                        let _ = shutdown_rx.await;
                    };
                    run(listener, run_config, shutdown).await
                });
                runtime.shutdown_timeout(Duration::from_secs(5));
                let _ = done_tx.send(result);
            })
            .expect("spawn the proxy thread");

        Proxy {
            addr,
            config,
            shutdown: Some(shutdown_tx),
            done: done_rx,
            thread: Some(thread),
        }
    }

    /// A proxy in front of `cluster` with [`Proxy::config_for`].
    pub fn for_cluster(cluster: &PgCluster) -> Proxy {
        Proxy::start(Proxy::config_for(cluster))
    }

    /// The default config with `upstream` pointing at `cluster` and a short shutdown drain
    /// (3 s) so a test that still holds a connection does not wait 30 s at drop.
    pub fn config_for(cluster: &PgCluster) -> Config {
        let mut config = Config::default();
        config.upstream.host = cluster.host().to_string();
        config.upstream.port = cluster.port();
        config.limits.shutdown_timeout = TEST_SHUTDOWN_TIMEOUT;
        config
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to (at 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The config the proxy runs with (`listen` set to [`Proxy::addr`]).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A key=value connection string for `db` through the proxy, as `postgres`.
    pub fn connstr(&self, db: &str) -> String {
        connstr(self.port(), db, SUPERUSER, None)
    }

    /// A key=value connection string for `db` through the proxy, as `user`.
    pub fn connstr_as(&self, db: &str, user: &str, password: Option<&str>) -> String {
        connstr(self.port(), db, user, password)
    }

    /// A tokio-postgres client through the proxy (inside a tokio runtime).
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        connect_to(&self.connstr(db)).await
    }

    /// Like [`PgCluster::psql`], through the proxy.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        run_psql(self.psql_cmd(), db, sql)
    }

    /// `psql -X -h 127.0.0.1 -p <proxy port> -U postgres`, to add arguments to.
    pub fn psql_cmd(&self) -> Command {
        psql_command(pg_bin_dir(), self.port())
    }

    /// Shuts the proxy down and returns what `pgfence::run` returned. Panics if it does not
    /// return within the shutdown timeout (plus a grace period) or panicked.
    pub fn shutdown(mut self) -> io::Result<()> {
        match self.stop() {
            Stopped::Returned(result) => result,
            Stopped::Panicked => panic!("pgfence::run panicked (see the output above)"),
            Stopped::Hung(waited) => {
                panic!("pgfence::run did not return {waited:?} after shutdown")
            }
        }
    }

    fn stop(&mut self) -> Stopped {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let Some(thread) = self.thread.take() else {
            return Stopped::Returned(Ok(()));
        };
        let wait = self.config.limits.shutdown_timeout + JOIN_GRACE;
        match self.done.recv_timeout(wait) {
            Ok(result) => {
                let _ = thread.join();
                Stopped::Returned(result)
            }
            // The thread ended without sending: it panicked.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                Stopped::Panicked
            }
            // Leave the thread behind rather than hang the test.
            Err(mpsc::RecvTimeoutError::Timeout) => Stopped::Hung(wait),
        }
    }
}

enum Stopped {
    Returned(io::Result<()>),
    Panicked,
    Hung(Duration),
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let problem = match self.stop() {
            Stopped::Returned(Ok(())) => return,
            Stopped::Returned(Err(e)) => format!("pgfence::run returned an error: {e}"),
            Stopped::Panicked => "pgfence::run panicked (see the output above)".to_string(),
            Stopped::Hung(waited) => {
                format!("pgfence::run did not return {waited:?} after shutdown")
            }
        };
        if thread::panicking() {
            eprintln!("harness: {problem}");
        } else {
            panic!("{problem}");
        }
    }
}

/// `pgfence::run`, named once so the expected signature is checked here.
fn run(
    listener: tokio::net::TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = io::Result<()>> {
    pgfence::run(listener, config, shutdown)
}
