//! The `pgfence` binary: flags, configuration, logging and signals around [`pgfence::run_with`].
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use pgfence::state::Shared;
use pgfence::ShutdownMode;
use pgfence_config::{
    ClientSslMode, Config, LogFormat, Overrides, Source, Upstream, UpstreamSslMode,
};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tracing::{error, info};

/// pgfence: a fencing-aware PostgreSQL proxy.
///
/// Point your application's connection string at pgfence instead of PostgreSQL. Writes whose
/// fencing token is lower than one already accepted for their resource are rolled back
/// (SQLSTATE FN001). Settings come from the config file, then PGFENCE_* environment
/// variables, then these flags (highest precedence).
#[derive(Debug, Parser)]
#[command(name = "pgfence", version, about, long_about)]
struct Cli {
    /// TOML configuration file (see pgfence.example.toml). Optional.
    #[arg(long, short = 'c', env = "PGFENCE_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Address to accept clients on [default: 127.0.0.1:6432].
    #[arg(long, env = "PGFENCE_LISTEN")]
    listen: Option<SocketAddr>,
    /// Also accept clients on a Unix-domain socket in DIR, DIR/.s.PGSQL.<listen port>
    /// [default: none].
    #[arg(long, value_name = "DIR", env = "PGFENCE_UNIX_SOCKET_DIR")]
    unix_socket_dir: Option<String>,
    /// Upstream PostgreSQL as HOST:PORT (or HOST, port 5432); a HOST starting with / is the
    /// directory of its Unix-domain socket, e.g. /var/run/postgresql:5432
    /// [default: 127.0.0.1:5432].
    #[arg(long, env = "PGFENCE_UPSTREAM", global = true)]
    upstream: Option<String>,
    /// TLS to the upstream server, as libpq's sslmode: disable, prefer, require, verify-ca
    /// or verify-full [default: disable].
    #[arg(
        long,
        value_name = "MODE",
        env = "PGFENCE_UPSTREAM_SSLMODE",
        global = true
    )]
    upstream_sslmode: Option<UpstreamSslMode>,
    /// PEM file with the CAs that sign the server's certificate (verify-ca, verify-full).
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_UPSTREAM_SSLROOTCERT",
        global = true
    )]
    upstream_sslrootcert: Option<PathBuf>,
    /// PEM file with the certificate pgfence presents to the server when it asks for one
    /// (libpq's sslcert) [default: none].
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_UPSTREAM_SSLCERT",
        global = true
    )]
    upstream_sslcert: Option<PathBuf>,
    /// PEM file with that certificate's private key (libpq's sslkey).
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_UPSTREAM_SSLKEY",
        global = true
    )]
    upstream_sslkey: Option<PathBuf>,
    /// Log format: text or json [default: text]. Filter with RUST_LOG (default: info).
    #[arg(long, env = "PGFENCE_LOG_FORMAT", value_parser = parse_log_format, global = true)]
    log_format: Option<LogFormat>,
    /// Serve Prometheus metrics at http://ADDR/metrics [default: off].
    #[arg(long, env = "PGFENCE_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Largest protocol message accepted, in bytes [default: 268435456].
    #[arg(long, env = "PGFENCE_MAX_MESSAGE_SIZE")]
    max_message_size: Option<u32>,
    /// Worker threads running client sessions, each a single-threaded runtime; a new session
    /// goes to the one with the fewest sessions [default: the number of CPUs pgfence may
    /// use; 1 behaves like PgBouncer's single thread].
    #[arg(long, env = "PGFENCE_THREADS", value_parser = parse_threads)]
    threads: Option<usize>,
    /// TLS for clients: disable, allow (or prefer: TLS when the client asks), require
    /// (plain TCP logins refused), verify-ca (and a client certificate signed by a CA of
    /// --client-tls-ca-file) or verify-full (and its CN is the user name) [default:
    /// disable]. Needs --client-tls-cert-file and --client-tls-key-file.
    #[arg(long, value_name = "MODE", env = "PGFENCE_CLIENT_TLS_SSLMODE")]
    client_tls_sslmode: Option<ClientSslMode>,
    /// PEM file with the certificate pgfence presents to TLS clients (then its chain).
    #[arg(long, value_name = "FILE", env = "PGFENCE_CLIENT_TLS_CERT_FILE")]
    client_tls_cert_file: Option<PathBuf>,
    /// PEM file with that certificate's private key.
    #[arg(long, value_name = "FILE", env = "PGFENCE_CLIENT_TLS_KEY_FILE")]
    client_tls_key_file: Option<PathBuf>,
    /// PEM file with the CA certificates that sign clients' certificates: needed by the
    /// verify modes; with allow or require, clients are asked for an optional certificate.
    #[arg(long, value_name = "FILE", env = "PGFENCE_CLIENT_TLS_CA_FILE")]
    client_tls_ca_file: Option<PathBuf>,
    /// Run as a plain proxy without the fence (for comparisons). PGFENCE_NO_FENCE takes
    /// 1, true, yes or on (and 0, false, no or off).
    #[arg(
        long,
        env = "PGFENCE_NO_FENCE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    no_fence: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade schema `pgfence` (fences, history, check function) in a database.
    ///
    /// Connects to the upstream of --upstream (PGFENCE_UPSTREAM, or the config file's
    /// `upstream`) with its TLS settings. Without --database it installs into the config
    /// file's `[fence.install] databases`, as `[fence.install] user`, and else into
    /// database postgres.
    Install {
        /// Database to install into; repeat for several [default: the config file's
        /// `[fence.install] databases`, else postgres].
        #[arg(long, short = 'd')]
        database: Vec<String>,
        /// User to connect as, who needs CREATE on the database [default: the config
        /// file's `[fence.install] user`, else postgres].
        #[arg(long, short = 'U', env = "PGUSER")]
        user: Option<String>,
        /// Password, if the server asks for one.
        #[arg(long, env = "PGPASSWORD", hide_env_values = true)]
        password: Option<String>,
        /// Role granted EXECUTE on the check function [default: the config file's
        /// `fence.grant_to`, else PUBLIC].
        #[arg(long)]
        grant_to: Option<String>,
    },
}

fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("pgfence needs at least 1 worker thread".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}: a number of worker threads, 1 or more")),
    }
}

fn parse_log_format(s: &str) -> Result<LogFormat, String> {
    match s {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!("unknown log format {other:?}: use text or json")),
    }
}

fn source(cli: &Cli) -> Result<Source, String> {
    let upstream = cli.upstream.as_deref().map(Upstream::parse).transpose()?;
    Ok(Source {
        path: cli.config.clone(),
        overrides: Overrides {
            listen: cli.listen,
            unix_socket_dir: cli.unix_socket_dir.clone(),
            upstream,
            upstream_sslmode: cli.upstream_sslmode,
            upstream_sslrootcert: cli.upstream_sslrootcert.clone(),
            upstream_sslcert: cli.upstream_sslcert.clone(),
            upstream_sslkey: cli.upstream_sslkey.clone(),
            log_format: cli.log_format,
            metrics_addr: cli.metrics_addr,
            max_message_size: cli.max_message_size,
            client_tls_sslmode: cli.client_tls_sslmode,
            client_tls_cert_file: cli.client_tls_cert_file.clone(),
            client_tls_key_file: cli.client_tls_key_file.clone(),
            client_tls_ca_file: cli.client_tls_ca_file.clone(),
            no_fence: cli.no_fence,
        },
    })
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

/// Logs a panic as one ERROR event instead of std's text on stderr, so that JSON logs stay
/// JSON and the event carries the fields operators filter on, and counts it in
/// `pgfence_panics_total`. A panic is a bug of pgfence's: the session whose task panicked
/// ends (see `Session::guarded`), the others go on. With `RUST_BACKTRACE=1` the event holds
/// the backtrace.
fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        pgfence::metrics::count_panic();
        let message = pgfence::error::panic_message(info.payload());
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_default();
        let backtrace = std::backtrace::Backtrace::capture();
        let backtrace = match backtrace.status() {
            std::backtrace::BacktraceStatus::Captured => backtrace.to_string(),
            _ => String::new(),
        };
        error!(
            thread = std::thread::current().name().unwrap_or("unnamed"),
            panic = message,
            location,
            backtrace,
            "pgfence bug: a thread panicked; if it ran a session, that session's connections \
             are closed and the others go on; please report this event"
        );
    }));
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (source, config) =
        match source(&cli).and_then(|s| s.load().map(|c| (s, c)).map_err(|e| e.to_string())) {
            Ok(loaded) => loaded,
            Err(e) => {
                eprintln!("pgfence: {e}");
                return ExitCode::from(2);
            }
        };
    // Certificate and key files are configuration too: refused before anything starts.
    if let Err(e) = pgfence::tls::acceptor(&config.client_tls)
        .and_then(|_| pgfence::tls::connector(&config.upstream))
    {
        eprintln!("pgfence: {e}");
        return ExitCode::from(2);
    }
    init_logging(config.telemetry.log_format);
    log_panics();
    // The main runtime accepts connections, serves metrics and handles signals; sessions
    // run on `--threads` worker threads of their own.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgfence: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Some(Command::Install {
            database,
            user,
            password,
            grant_to,
        }) => {
            let from_config = config.fence.install.as_ref();
            let databases = match (database.is_empty(), from_config) {
                (false, _) => database,
                (true, Some(install)) if !install.databases.is_empty() => install.databases.clone(),
                _ => vec!["postgres".to_string()],
            };
            let user = user
                .or_else(|| from_config.map(|i| i.user.clone()))
                .unwrap_or_else(|| "postgres".to_string());
            runtime.block_on(async {
                for database in &databases {
                    pgfence::install::install(
                        &config,
                        database,
                        &user,
                        password.as_deref(),
                        grant_to.as_deref(),
                    )
                    .await?;
                }
                Ok(())
            })
        }
        None => {
            let threads = cli.threads.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            });
            runtime.block_on(serve(config, source, threads))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // Logged once, as an event (JSON logs stay JSON); stderr has it either way.
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config, source: Source, threads: usize) -> Result<(), String> {
    // Signal handlers first: a SIGHUP sent as soon as the port accepts clients must reload,
    // not kill the process (the default action of a signal not handled yet).
    let hup = signal(SignalKind::hangup()).map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    let stopping = tokio_util::sync::CancellationToken::new();
    let shutdown = signals(stopping.clone())?;
    if let Some(install) = &config.fence.install {
        let password = std::env::var("PGPASSWORD").ok();
        for database in &install.databases {
            pgfence::install::install(&config, database, &install.user, password.as_deref(), None)
                .await?;
        }
    }
    let socket_path = config.client_socket_path();
    // Before the TCP port: whoever sees that accept clients may use the socket too.
    let unix = match &socket_path {
        Some(path) => Some(pgfence::net::bind_client_socket(path)?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let metrics_listener = match config.telemetry.metrics_addr {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?,
        ),
        None => None,
    };
    info!(
        listen = %config.listen,
        unix_socket = socket_path.as_ref().map(|p| tracing::field::display(p.display())),
        upstream = %config.upstream,
        upstream_sslmode = %config.upstream.sslmode,
        client_tls = %config.client_tls.sslmode,
        fence = config.fence.enabled,
        metrics = config.telemetry.metrics_addr.map(tracing::field::display),
        threads,
        "pgfence started"
    );
    let shared = Arc::new(Shared::new(Arc::new(config))?);
    shared.set_source(source);
    if let Some(listener) = metrics_listener {
        // Released with the client port when a shutdown begins, so that a new pgfence
        // started during the drain can take both (a rolling restart).
        let metrics = shared.metrics.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = pgfence::metrics::serve(listener, metrics) => {}
                () = stopping.cancelled() => {}
            }
        });
    }
    tokio::spawn(reload_on_sighup(shared.clone(), hup));
    let workers = pgfence::Workers::start(threads, &shared.metrics)
        .map_err(|e| format!("cannot start worker threads: {e}"))?;
    let served = pgfence::run_with(listener, unix, shared, Some(workers), shutdown).await;
    if let Some(path) = &socket_path {
        let _ = std::fs::remove_file(path);
    }
    if served.is_ok() {
        info!("pgfence stopped");
    }
    served.map_err(|e| e.to_string())
}

/// SIGHUP reloads the configuration file, as RELOAD on the admin console does.
async fn reload_on_sighup(shared: Arc<Shared>, mut hup: Signal) {
    while hup.recv().await.is_some() {
        info!("SIGHUP: reloading the configuration");
        // Failures are logged by reload; the old configuration stays in force.
        let _ = shared.reload();
    }
}

/// SIGTERM waits for clients, SIGINT drains, SIGQUIT closes every session now (PgBouncer's
/// meanings); during a shutdown, SIGINT turns a wait for clients into a drain and any
/// other of them makes it immediate. The handlers are installed now; the modes go to
/// [`pgfence::run_with`] as the signals come, and the first cancels `stopping`.
fn signals(
    stopping: tokio_util::sync::CancellationToken,
) -> Result<tokio::sync::mpsc::Receiver<ShutdownMode>, String> {
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| format!("cannot handle SIGINT: {e}"))?;
    let mut quit = signal(SignalKind::quit()).map_err(|e| format!("cannot handle SIGQUIT: {e}"))?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let mut current = None;
        loop {
            let (name, asked) = tokio::select! {
                _ = term.recv() => ("SIGTERM", ShutdownMode::WaitForClients),
                _ = int.recv() => ("SIGINT", ShutdownMode::Drain),
                _ = quit.recv() => ("SIGQUIT", ShutdownMode::Immediate),
            };
            let mode = match (current, asked) {
                (None, asked) => asked,
                (Some(ShutdownMode::WaitForClients), ShutdownMode::Drain) => ShutdownMode::Drain,
                (Some(_), _) => ShutdownMode::Immediate,
            };
            let effect = match mode {
                ShutdownMode::WaitForClients => "waiting for clients to disconnect",
                ShutdownMode::Drain => "closing sessions as they become idle",
                ShutdownMode::Immediate => "closing every session now",
            };
            info!(signal = name, "{name}: {effect}");
            current = Some(mode);
            stopping.cancel();
            if tx.send(mode).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}
