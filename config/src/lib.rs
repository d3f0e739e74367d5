//! pgfence configuration: the TOML file's types, their defaults and one `validate()`.
//!
//! Every field documents its default. Unknown keys are errors (`deny_unknown_fields`), so a
//! typo in a config file is reported instead of silently ignored. The example file
//! `pgfence.example.toml` at the repository root shows every key and is tested to parse.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use fence_core::token::Resource;
use serde::{Deserialize, Serialize};

/// Everything pgfence reads from its configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where clients connect. Default `127.0.0.1:6432`.
    pub listen: SocketAddr,
    /// A directory where clients can also connect through a Unix-domain socket,
    /// `<dir>/.s.PGSQL.<listen port>` (PgBouncer's `unix_socket_dir`): `psql -h <dir> -p
    /// <port>`. Default: none (TCP only).
    pub unix_socket_dir: Option<String>,
    /// The PostgreSQL server every session is forwarded to.
    pub upstream: Upstream,
    /// TLS between clients and pgfence (PgBouncer's `client_tls_*`).
    pub client_tls: ClientTls,
    /// Connection limits and timeouts.
    pub limits: Limits,
    /// Reuse of server connections between client sessions.
    pub pool: Pool,
    /// The fence: which resources exist and what happens without a token.
    pub fence: Fence,
    /// The admin console (virtual database `pgfence`).
    pub admin: Admin,
    /// Logs and metrics.
    pub telemetry: Telemetry,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 6432)),
            unix_socket_dir: None,
            upstream: Upstream::default(),
            client_tls: ClientTls::default(),
            limits: Limits::default(),
            pool: Pool::default(),
            fence: Fence::default(),
            admin: Admin::default(),
            telemetry: Telemetry::default(),
        }
    }
}

/// The upstream PostgreSQL server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Upstream {
    /// Host name or IP address of PostgreSQL, or the directory of its Unix-domain socket
    /// (a path starting with `/`, as libpq and PgBouncer read `host`: the socket is
    /// `<host>/.s.PGSQL.<port>`). Default `127.0.0.1`.
    pub host: String,
    /// Port of PostgreSQL. Default `5432`.
    pub port: u16,
    /// TLS to the server, as libpq's `sslmode` (PgBouncer's `server_tls_sslmode`): `disable`,
    /// `prefer`, `require`, `verify-ca` or `verify-full`. Default `disable`. Not used for a
    /// Unix-domain socket.
    pub sslmode: UpstreamSslMode,
    /// PEM file with the certificate authorities that sign the server's certificate, for
    /// `verify-ca` and `verify-full` (libpq's `sslrootcert`). Default: none.
    pub sslrootcert: Option<std::path::PathBuf>,
    /// PEM file with the certificate pgfence presents to the server when it asks for one
    /// (libpq's `sslcert`; `clientcert=verify-ca` or `cert` in `pg_hba.conf`). The same
    /// certificate serves every session. Default: none.
    pub sslcert: Option<std::path::PathBuf>,
    /// PEM file with that certificate's private key (libpq's `sslkey`).
    pub sslkey: Option<std::path::PathBuf>,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            host: "127.0.0.1".into(),
            port: 5432,
            sslmode: UpstreamSslMode::Disable,
            sslrootcert: None,
            sslcert: None,
            sslkey: None,
        }
    }
}

/// TLS to the upstream server, with libpq's `sslmode` names and meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum UpstreamSslMode {
    /// Plain TCP.
    #[default]
    Disable,
    /// TLS if the server offers it, plain otherwise; the certificate is not checked.
    Prefer,
    /// TLS, or no connection; the certificate is not checked.
    Require,
    /// TLS with a certificate signed by a CA of `sslrootcert`, for any host name.
    VerifyCa,
    /// TLS with a certificate signed by a CA of `sslrootcert` and issued for `host`.
    VerifyFull,
}

impl std::fmt::Display for UpstreamSslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            UpstreamSslMode::Disable => "disable",
            UpstreamSslMode::Prefer => "prefer",
            UpstreamSslMode::Require => "require",
            UpstreamSslMode::VerifyCa => "verify-ca",
            UpstreamSslMode::VerifyFull => "verify-full",
        })
    }
}

impl std::str::FromStr for UpstreamSslMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(UpstreamSslMode::Disable),
            "prefer" => Ok(UpstreamSslMode::Prefer),
            "require" => Ok(UpstreamSslMode::Require),
            "verify-ca" => Ok(UpstreamSslMode::VerifyCa),
            "verify-full" => Ok(UpstreamSslMode::VerifyFull),
            other => Err(format!(
                "unknown upstream TLS mode {other:?}: use disable, prefer, require, verify-ca or verify-full"
            )),
        }
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Whether clients may or must use TLS (PgBouncer's `client_tls_sslmode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ClientSslMode {
    /// Decline TLS: an SSLRequest is answered `N`, as by a server without SSL.
    #[default]
    Disable,
    /// TLS for clients that ask for it (`sslmode=prefer` or `require` in libpq), plain
    /// connections for the others. `prefer` means the same, as in PgBouncer.
    #[serde(alias = "prefer")]
    Allow,
    /// TLS for every TCP client: a plain login is refused with SQLSTATE 28000. Clients of
    /// the Unix-domain socket are local and never use TLS, as with PostgreSQL.
    Require,
    /// As `require`, and the client must present a certificate signed by a CA of
    /// `ca_file` (PostgreSQL's `clientcert=verify-ca`).
    VerifyCa,
    /// As `verify-ca`, and the certificate's common name (CN) must be the user name the
    /// client logs in as (PostgreSQL's `clientcert=verify-full`).
    VerifyFull,
}

impl ClientSslMode {
    /// Every TCP client must use TLS.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            ClientSslMode::Require | ClientSslMode::VerifyCa | ClientSslMode::VerifyFull
        )
    }

    /// Every TCP client must present a certificate signed by a CA of `ca_file`.
    pub fn requires_certificate(self) -> bool {
        matches!(self, ClientSslMode::VerifyCa | ClientSslMode::VerifyFull)
    }
}

impl std::fmt::Display for ClientSslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ClientSslMode::Disable => "disable",
            ClientSslMode::Allow => "allow",
            ClientSslMode::Require => "require",
            ClientSslMode::VerifyCa => "verify-ca",
            ClientSslMode::VerifyFull => "verify-full",
        })
    }
}

impl std::str::FromStr for ClientSslMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(ClientSslMode::Disable),
            "allow" | "prefer" => Ok(ClientSslMode::Allow),
            "require" => Ok(ClientSslMode::Require),
            "verify-ca" => Ok(ClientSslMode::VerifyCa),
            "verify-full" => Ok(ClientSslMode::VerifyFull),
            other => Err(format!(
                "unknown client TLS mode {other:?}: use disable, allow, prefer, require, verify-ca or verify-full"
            )),
        }
    }
}

/// TLS that pgfence terminates for its clients. pgfence presents its own certificate; the
/// connection to the upstream server is a separate one (see [`Upstream`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ClientTls {
    /// `disable`, `allow` (or `prefer`), `require`, `verify-ca` or `verify-full`. Default
    /// `disable`.
    pub sslmode: ClientSslMode,
    /// PEM file with pgfence's certificate, then the intermediate certificates of its
    /// chain, if any. Required unless `sslmode` is `disable`. Read at start and at reload.
    pub cert_file: Option<std::path::PathBuf>,
    /// PEM file with the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<std::path::PathBuf>,
    /// PEM file with the CA certificates that sign clients' certificates (PgBouncer's
    /// `client_tls_ca_file`). Required by `verify-ca` and `verify-full`; with `allow` or
    /// `require`, clients are asked for a certificate, may send none, and one they send
    /// must be signed by one of these CAs.
    pub ca_file: Option<std::path::PathBuf>,
}

/// Limits that protect the proxy from misbehaving clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Most client connections served at once; further ones get `53300 too_many_connections`.
    /// Default 1000.
    pub max_client_connections: usize,
    /// Largest protocol message accepted from a client or the server, in bytes. Larger
    /// length fields close that connection with an error. Default 256 MiB.
    pub max_message_size: u32,
    /// How long a client may take to send its startup packet. Default `15s`.
    #[serde(with = "humantime_serde")]
    pub startup_timeout: Duration,
    /// How long connecting to the upstream may take (for a session, or to forward a cancel
    /// request, TLS handshake included), and how long the server may take to answer a
    /// session's startup packet. Default `10s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// On SIGTERM, how long sessions may take to finish before they are closed. Default `30s`.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// TCP keepalive on client and server connections (PgBouncer's `tcp_keepalive`;
    /// PostgreSQL sets it on every client connection): a peer that vanished without a word
    /// (its host frozen or gone, its network cut) is found, its session ended, and the
    /// transaction and locks its server backend held rolled back. The server's own
    /// `tcp_keepalives_*` settings reach only pgfence's connection. Default `true`.
    pub tcp_keepalive: bool,
    /// Idle time before the first keepalive probe (PostgreSQL's `tcp_keepalives_idle`, at
    /// least `1s`). Default: the system's (Linux: 2 hours).
    #[serde(with = "humantime_serde")]
    pub tcp_keepalives_idle: Option<Duration>,
    /// Time between unanswered probes (`tcp_keepalives_interval`, at least `1s`). Default:
    /// the system's (Linux: 75 s).
    #[serde(with = "humantime_serde")]
    pub tcp_keepalives_interval: Option<Duration>,
    /// Unanswered probes after which the connection is dead (`tcp_keepalives_count`, at
    /// least 1). Default: the system's (Linux: 9).
    pub tcp_keepalives_count: Option<u32>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_client_connections: 1000,
            max_message_size: 256 * 1024 * 1024,
            startup_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
            tcp_keepalive: true,
            tcp_keepalives_idle: None,
            tcp_keepalives_interval: None,
            tcp_keepalives_count: None,
        }
    }
}

/// Server connections kept for the next client session, as in PgBouncer's session mode.
///
/// When a client disconnects while its server session is idle, pgfence resets the server
/// session (`DISCARD ALL`) and keeps the connection for the next client that sends the
/// same startup packet (same user, database and options), which then starts without a
/// new backend process. Only connections whose login the server accepted without asking
/// for a password are kept: a client reusing one must not skip a check it would have met.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pool {
    /// Keep server connections for reuse. Default `true`.
    pub reuse_servers: bool,
    /// Most idle server connections kept, all users and databases together. Default 100.
    pub max_idle_servers: usize,
    /// An idle server connection unused this long is closed. Default `600s`
    /// (PgBouncer's `server_idle_timeout`).
    #[serde(with = "humantime_serde")]
    pub server_idle_timeout: Duration,
    /// A server connection this old is closed instead of being kept. Default `3600s`
    /// (PgBouncer's `server_lifetime`).
    #[serde(with = "humantime_serde")]
    pub server_lifetime: Duration,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            reuse_servers: true,
            max_idle_servers: 100,
            server_idle_timeout: Duration::from_secs(600),
            server_lifetime: Duration::from_secs(3600),
        }
    }
}

/// What to do with a write transaction that carries no token for its resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingToken {
    /// Roll the transaction back with FN002.
    Reject,
    /// Let it commit unfenced.
    Allow,
}

/// The fence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fence {
    /// Inject the commit-time check. `false` makes pgfence a plain proxy (for comparison in
    /// benchmarks and tests). Default `true`.
    pub enabled: bool,
    /// Reject writes whose token is already known to be stale without sending them to the
    /// server (SPEC section 6). Default `true`.
    pub fast_path: bool,
    /// Skip the check for transactions whose every statement the classifier reads as a read
    /// (see fence-core's classifier). `false` checks every transaction. Default `true`.
    pub skip_read_only: bool,
    /// With `skip_read_only`, skip reads' checks only in a database whose schema gives no
    /// read a way to call a function of its own (a view, row-level security policy, domain,
    /// operator, cast, ... through one): pgfence asks `pgfence.reads_may_write(9)` when a
    /// client session starts, and checks every transaction of the session when it says
    /// true. `false` trusts the classifier alone (a read that writes through such an object
    /// then commits unchecked). Default `true`.
    pub read_audit: bool,
    /// How old an answer of the read audit a session acts on: once its answer is older, the
    /// session's next transaction checks its reads and asks again (or takes another
    /// session's answer younger than this). Sessions starting take another's answer as
    /// young. `0s` asks before every transaction. Default `1s`.
    #[serde(with = "humantime_serde")]
    pub read_audit_max_age: Duration,
    /// Create or upgrade schema `pgfence` in these databases when the proxy starts.
    /// Default: not set, do not install (run `pgfence install` instead).
    pub install: Option<InstallOnStart>,
    /// The role that gets EXECUTE on the check function when pgfence installs the schema.
    /// Default `PUBLIC`.
    pub grant_to: Option<String>,
    /// Policy for a missing token, for resources not listed in `resources`. Default `reject`.
    pub on_missing_token: OnMissingToken,
    /// Per-resource settings, keyed by resource name.
    pub resources: BTreeMap<String, ResourcePolicy>,
    /// Default resource for sessions that do not name one, by database (and optionally user).
    pub defaults: Vec<DefaultResource>,
}

impl Default for Fence {
    fn default() -> Self {
        Fence {
            enabled: true,
            fast_path: true,
            skip_read_only: true,
            read_audit: true,
            read_audit_max_age: Duration::from_secs(1),
            install: None,
            grant_to: None,
            on_missing_token: OnMissingToken::Reject,
            resources: BTreeMap::new(),
            defaults: Vec::new(),
        }
    }
}

/// Installing the schema when the proxy starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstallOnStart {
    /// User to connect as (needs CREATE on each database). Its password, if the server asks
    /// for one, comes from the `PGPASSWORD` environment variable.
    pub user: String,
    /// Databases to install into.
    pub databases: Vec<String>,
}

/// Settings of one resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcePolicy {
    /// What a write without a token gets. Default: `fence.on_missing_token`.
    pub on_missing_token: Option<OnMissingToken>,
}

/// A default resource: sessions to `database` (and `user`, when set) are fenced on
/// `resource` unless they name another one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefaultResource {
    /// Database name the session connects to.
    pub database: String,
    /// User name; when not set the default applies to every user of the database.
    pub user: Option<String>,
    /// The resource.
    pub resource: String,
}

impl Fence {
    /// The default resource of a session, if any: a user-specific entry wins over a
    /// database-wide one.
    pub fn default_resource(&self, database: &str, user: &str) -> Option<&str> {
        let mut found = None;
        for d in self.defaults.iter().filter(|d| d.database == database) {
            match &d.user {
                Some(u) if u == user => return Some(&d.resource),
                Some(_) => {}
                None => found = found.or(Some(d.resource.as_str())),
            }
        }
        found
    }

    /// Resources whose missing tokens are allowed; every other resource rejects.
    ///
    /// When the global policy is `allow`, the database check cannot know the resources a
    /// session may name, so the list is `["*"]`, understood by the check as "every resource".
    pub fn allow_missing(&self) -> Vec<String> {
        if self.on_missing_token == OnMissingToken::Allow {
            let rejecting = self
                .resources
                .values()
                .any(|p| p.on_missing_token == Some(OnMissingToken::Reject));
            if !rejecting {
                return vec!["*".to_string()];
            }
        }
        self.resources
            .iter()
            .filter(|(_, p)| {
                p.on_missing_token.unwrap_or(self.on_missing_token) == OnMissingToken::Allow
            })
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// The admin console.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admin {
    /// Users allowed to connect to the virtual database `pgfence`. They authenticate
    /// against the upstream server with their own password. Default: none (console off).
    pub users: Vec<String>,
    /// The upstream database the console logs in to and reads `pgfence.fences` from.
    /// Default `postgres`.
    pub database: String,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            users: Vec::new(),
            database: "postgres".into(),
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Logs and metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Telemetry {
    /// Log format. Default `text`.
    pub log_format: LogFormat,
    /// Where to serve Prometheus metrics over HTTP (`/metrics`). Default: not served.
    pub metrics_addr: Option<SocketAddr>,
}

/// A configuration that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {source}")]
    Parse {
        path: String,
        source: toml::de::Error,
    },
    /// A file that parses but does not validate: named, so the operator knows which one.
    #[error("config file {path} is not valid: {message}")]
    InvalidFile { path: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Settings given on the command line or in `PGFENCE_*` variables: they win over the file,
/// also after a reload.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub unix_socket_dir: Option<String>,
    pub upstream: Option<Upstream>,
    pub upstream_sslmode: Option<UpstreamSslMode>,
    pub upstream_sslrootcert: Option<std::path::PathBuf>,
    pub upstream_sslcert: Option<std::path::PathBuf>,
    pub upstream_sslkey: Option<std::path::PathBuf>,
    pub log_format: Option<LogFormat>,
    pub metrics_addr: Option<SocketAddr>,
    pub max_message_size: Option<u32>,
    pub client_tls_sslmode: Option<ClientSslMode>,
    pub client_tls_cert_file: Option<std::path::PathBuf>,
    pub client_tls_key_file: Option<std::path::PathBuf>,
    pub client_tls_ca_file: Option<std::path::PathBuf>,
    pub no_fence: bool,
}

impl Overrides {
    /// Applies the overrides to a configuration.
    pub fn apply(&self, config: &mut Config) {
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        if let Some(dir) = &self.unix_socket_dir {
            config.unix_socket_dir = Some(dir.clone());
        }
        if let Some(upstream) = &self.upstream {
            // Where, not how: TLS settings come from their own overrides or the file.
            config.upstream.host = upstream.host.clone();
            config.upstream.port = upstream.port;
        }
        if let Some(mode) = self.upstream_sslmode {
            config.upstream.sslmode = mode;
        }
        if let Some(path) = &self.upstream_sslrootcert {
            config.upstream.sslrootcert = Some(path.clone());
        }
        if let Some(path) = &self.upstream_sslcert {
            config.upstream.sslcert = Some(path.clone());
        }
        if let Some(path) = &self.upstream_sslkey {
            config.upstream.sslkey = Some(path.clone());
        }
        if let Some(format) = self.log_format {
            config.telemetry.log_format = format;
        }
        if let Some(addr) = self.metrics_addr {
            config.telemetry.metrics_addr = Some(addr);
        }
        if let Some(max) = self.max_message_size {
            config.limits.max_message_size = max;
        }
        if let Some(mode) = self.client_tls_sslmode {
            config.client_tls.sslmode = mode;
        }
        if let Some(path) = &self.client_tls_cert_file {
            config.client_tls.cert_file = Some(path.clone());
        }
        if let Some(path) = &self.client_tls_key_file {
            config.client_tls.key_file = Some(path.clone());
        }
        if let Some(path) = &self.client_tls_ca_file {
            config.client_tls.ca_file = Some(path.clone());
        }
        if self.no_fence {
            config.fence.enabled = false;
        }
    }
}

/// Where the configuration comes from: an optional file plus overrides. Reloading reads
/// the file again and applies the same overrides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Source {
    pub path: Option<std::path::PathBuf>,
    pub overrides: Overrides,
}

impl Source {
    /// Reads and validates the configuration.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.path {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        self.overrides.apply(&mut config);
        config.validate()?;
        Ok(config)
    }
}

/// PostgreSQL's name for the socket of `port` in `dir`: `<dir>/.s.PGSQL.<port>`.
pub fn socket_file(dir: &str, port: u16) -> std::path::PathBuf {
    Path::new(dir).join(format!(".s.PGSQL.{port}"))
}

impl Upstream {
    /// The host is the directory of a Unix-domain socket (it starts with `/`).
    pub fn is_socket_dir(&self) -> bool {
        self.host.starts_with('/')
    }

    /// The socket file of a Unix-domain upstream, `None` for a host that is not a
    /// directory path.
    pub fn socket_path(&self) -> Option<std::path::PathBuf> {
        self.is_socket_dir()
            .then(|| socket_file(&self.host, self.port))
    }

    /// Parses `host:port`, `[v6]:port` or a bare host (port 5432); a host starting with `/`
    /// is a socket directory (`/var/run/postgresql:5432`).
    pub fn parse(s: &str) -> Result<Upstream, String> {
        let bad = || format!("invalid upstream {s:?}: expected HOST:PORT");
        if let Some(rest) = s.strip_prefix('[') {
            let (host, port) = rest.split_once("]:").ok_or_else(bad)?;
            return Ok(Upstream {
                host: host.to_string(),
                port: port.parse().map_err(|_| bad())?,
                ..Upstream::default()
            });
        }
        match s.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => Ok(Upstream {
                host: host.to_string(),
                port: port.parse().map_err(|_| bad())?,
                ..Upstream::default()
            }),
            _ if s.is_empty() => Err(bad()),
            _ => Ok(Upstream {
                host: s.to_string(),
                port: 5432,
                ..Upstream::default()
            }),
        }
    }
}

impl Config {
    /// The socket file clients connect to in `unix_socket_dir`, if one is set.
    pub fn client_socket_path(&self) -> Option<std::path::PathBuf> {
        self.unix_socket_dir
            .as_ref()
            .map(|dir| socket_file(dir, self.listen.port()))
    }

    /// Settings that only take effect at start: what differs between `self` and `new`.
    pub fn restart_only_changes(&self, new: &Config) -> Vec<&'static str> {
        let mut changed = Vec::new();
        if self.listen != new.listen {
            changed.push("listen");
        }
        if self.unix_socket_dir != new.unix_socket_dir {
            changed.push("unix_socket_dir");
        }
        if self.telemetry.metrics_addr != new.telemetry.metrics_addr {
            changed.push("telemetry.metrics_addr");
        }
        if self.telemetry.log_format != new.telemetry.log_format {
            changed.push("telemetry.log_format");
        }
        if self.fence.install != new.fence.install {
            changed.push("fence.install");
        }
        changed
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let config: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        config.validate().map_err(|e| match e {
            ConfigError::Invalid(message) => ConfigError::InvalidFile {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })?;
        Ok(config)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.upstream.host.is_empty() {
            return invalid("upstream.host is empty".into());
        }
        if self.upstream.port == 0 {
            return invalid("upstream.port must not be 0".into());
        }
        if let Some(dir) = &self.unix_socket_dir {
            if !dir.starts_with('/') {
                return invalid(format!(
                    "unix_socket_dir {dir:?} must be an absolute directory path"
                ));
            }
        }
        if matches!(
            self.upstream.sslmode,
            UpstreamSslMode::VerifyCa | UpstreamSslMode::VerifyFull
        ) && self.upstream.sslrootcert.is_none()
        {
            return invalid(format!(
                "upstream.sslmode = {} needs upstream.sslrootcert (a PEM file with the \
                 certificate authorities that sign the server's certificate)",
                self.upstream.sslmode
            ));
        }
        if self.upstream.sslcert.is_some() != self.upstream.sslkey.is_some() {
            return invalid(
                "upstream.sslcert and upstream.sslkey go together: set both or neither".into(),
            );
        }
        if self.upstream.sslcert.is_some() && self.upstream.sslmode == UpstreamSslMode::Disable {
            return invalid(
                "upstream.sslcert is set but upstream.sslmode = disable: the certificate would never be sent"
                    .into(),
            );
        }
        if self.client_tls.sslmode != ClientSslMode::Disable {
            let mode = self.client_tls.sslmode;
            if self.client_tls.cert_file.is_none() || self.client_tls.key_file.is_none() {
                return invalid(format!(
                    "client_tls.sslmode = {mode} needs client_tls.cert_file and \
                     client_tls.key_file (PEM files with pgfence's certificate and its key)"
                ));
            }
            if mode.requires_certificate() && self.client_tls.ca_file.is_none() {
                return invalid(format!(
                    "client_tls.sslmode = {mode} needs client_tls.ca_file (a PEM file with the \
                     CA certificates that sign the clients' certificates)"
                ));
            }
        } else if self.client_tls.ca_file.is_some() {
            return invalid(
                "client_tls.ca_file is set but client_tls.sslmode = disable: no client would ever be asked for a certificate"
                    .into(),
            );
        }
        if self.limits.max_client_connections == 0 {
            return invalid("limits.max_client_connections must be at least 1".into());
        }
        if self.limits.max_message_size < 1024 {
            return invalid("limits.max_message_size must be at least 1024 bytes".into());
        }
        // Zero would refuse every client (its startup packet, its server's first reply)
        // at once: a reload once took such a value and shut everyone out, the console too.
        for (name, value) in [
            ("startup_timeout", self.limits.startup_timeout),
            ("connect_timeout", self.limits.connect_timeout),
        ] {
            if value < Duration::from_millis(100) {
                return invalid(format!("limits.{name} must be at least 100ms"));
            }
        }
        // Linux's bounds (TCP_KEEPIDLE and TCP_KEEPINTVL up to 32767 s, TCP_KEEPCNT up to
        // 127): a value the kernel refuses would fail every connection.
        for (name, value) in [
            ("tcp_keepalives_idle", self.limits.tcp_keepalives_idle),
            (
                "tcp_keepalives_interval",
                self.limits.tcp_keepalives_interval,
            ),
        ] {
            if let Some(d) = value {
                if d < Duration::from_secs(1)
                    || d > Duration::from_secs(32767)
                    || d.subsec_nanos() != 0
                {
                    return invalid(format!(
                        "limits.{name} must be a whole number of seconds from 1s to 32767s"
                    ));
                }
            }
        }
        if self
            .limits
            .tcp_keepalives_count
            .is_some_and(|n| !(1..=127).contains(&n))
        {
            return invalid("limits.tcp_keepalives_count must be from 1 to 127".into());
        }
        for name in self.fence.resources.keys() {
            if let Err(e) = Resource::parse(name.as_bytes()) {
                return invalid(format!("fence.resources.{name}: {e}"));
            }
        }
        for d in &self.fence.defaults {
            if let Err(e) = Resource::parse(d.resource.as_bytes()) {
                return invalid(format!(
                    "fence.defaults (database {:?}): resource {:?}: {e}",
                    d.database, d.resource
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
