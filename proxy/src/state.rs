//! State shared by all sessions of one pgfence process: the configuration in force, cancel
//! routing, the fences seen so far (for the fast path), recent rejections and counters.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::SystemTime;

use dashmap::DashMap;
use pgfence_config::{Config, Source};
use tracing::{info, warn};

use crate::cancel::CancelRegistry;

/// How many rejections `SHOW REJECTIONS` keeps.
pub const REJECTIONS_KEPT: usize = 100;

/// Everything sessions share.
#[derive(Debug)]
pub struct Shared {
    config: RwLock<Arc<Config>>,
    /// rustls' configurations built from `config`'s TLS settings and files.
    tls: RwLock<TlsConfigs>,
    pub cancel: CancelRegistry,
    pub fences: KnownFences,
    pub rejections: Mutex<VecDeque<RejectionRecord>>,
    pub clients: DashMap<u64, ClientInfo>,
    pub stats: Stats,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Idle server connections kept for the next client.
    pub pool: crate::pool::ServerPool,
    next_client_id: AtomicU64,
    active: Arc<AtomicUsize>,
    /// Where the configuration was read from, for RELOAD and SIGHUP.
    source: Mutex<Option<Source>>,
    /// What was already logged once per database: (what, database).
    reported: Mutex<std::collections::HashSet<(&'static str, String)>>,
    /// What sessions learnt of each database from `pgfence.reads_may_write(9)`, and when.
    read_audit: Mutex<std::collections::HashMap<String, (std::time::Instant, ReadAuditKnown)>>,
    /// Some database in `read_audit` is known to lack the function.
    read_audit_missing: AtomicBool,
}

/// How long sessions in a database found without schema pgfence (reads skip the check as
/// the classifier says, unless a check runs there first) or with one older than version 9
/// (every transaction is checked) skip the question: each would log an error on the
/// server.
pub const READ_AUDIT_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

/// What is known of a database's `pgfence.reads_may_write(9)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadAuditKnown {
    /// Its answer.
    MayWrite(bool),
    /// Schema pgfence is missing (or the function, where the schema was found too old).
    NoFunction,
    /// Schema pgfence is older than version 9 (no `pgfence.reads_may_write(integer)`):
    /// reads are checked.
    OldSchema,
}

/// Counts a session as active while it lives.
#[derive(Debug)]
pub struct ActiveGuard(Arc<AtomicUsize>, Arc<crate::metrics::Metrics>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.client_connections.dec();
    }
}

impl Shared {
    /// State for `config`; fails when its TLS certificate or key cannot be used.
    pub fn new(config: Arc<Config>) -> Result<Shared, String> {
        let tls = TlsConfigs::new(&config)?;
        let metrics = Arc::new(crate::metrics::Metrics::default());
        Ok(Shared {
            config: RwLock::new(config),
            tls: RwLock::new(tls),
            cancel: CancelRegistry::default(),
            fences: KnownFences::default(),
            rejections: Mutex::new(VecDeque::with_capacity(REJECTIONS_KEPT)),
            clients: DashMap::new(),
            stats: Stats::default(),
            pool: crate::pool::ServerPool::new(
                metrics.upstream_idle.clone(),
                metrics.upstream_reused.clone(),
            ),
            metrics,
            next_client_id: AtomicU64::new(1),
            active: Arc::new(AtomicUsize::new(0)),
            source: Mutex::new(None),
            reported: Mutex::new(std::collections::HashSet::new()),
            read_audit: Mutex::new(std::collections::HashMap::new()),
            read_audit_missing: AtomicBool::new(false),
        })
    }

    /// Whether this is the first time `database` is found to lack schema pgfence (the
    /// caller logs it then).
    pub fn first_report_of_missing_schema(&self, database: &str) -> bool {
        self.first_report("schema missing", database)
    }

    /// Whether this is the first time this process reports `what` of `database` (the
    /// caller logs it then).
    pub fn first_report(&self, what: &'static str, database: &str) -> bool {
        self.reported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((what, database.to_string()))
    }

    /// What a session starting now may take as the answer of `pgfence.reads_may_write(9)`
    /// in `database`, without asking: an answer given less than `max_age` ago
    /// (`fence.read_audit_max_age`: a client that connects for each transaction would
    /// otherwise pay the question each time),
    /// or the lack of the function found less than [`READ_AUDIT_RETRY`] ago; with when it
    /// was learnt.
    pub fn known_read_audit(
        &self,
        database: &str,
        max_age: std::time::Duration,
    ) -> Option<(std::time::Instant, ReadAuditKnown)> {
        let map = self
            .read_audit
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let &(at, known) = map.get(database)?;
        let fresh_for = match known {
            ReadAuditKnown::MayWrite(_) => max_age,
            ReadAuditKnown::NoFunction | ReadAuditKnown::OldSchema => READ_AUDIT_RETRY,
        };
        (at.elapsed() < fresh_for).then_some((at, known))
    }

    /// A question to the read audit was sent (`read_audit_questions` in `SHOW STATS`,
    /// `pgfence_read_audit_questions_total`).
    pub fn count_read_audit_question(&self) {
        Stats::add(&self.stats.read_audit_questions);
        self.metrics.read_audit_questions.inc();
    }

    /// Remembers what a session learnt of `database`, by a question sent at `at`, unless a
    /// question sent later was answered first.
    pub fn learn_read_audit(&self, database: &str, known: ReadAuditKnown, at: std::time::Instant) {
        if known == ReadAuditKnown::NoFunction {
            self.read_audit_missing.store(true, Ordering::Relaxed);
        }
        let mut map = self
            .read_audit
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match map.get_mut(database) {
            Some(entry) if entry.0 > at => {}
            Some(entry) => *entry = (at, known),
            None => {
                map.insert(database.to_string(), (at, known));
            }
        }
    }

    /// A check ran in `database`, so schema pgfence is there now: a lack of it found
    /// earlier is asked about again at the next session start (one relaxed load unless
    /// some database was found without it).
    #[inline]
    pub fn check_ran(&self, database: &str) {
        if self.read_audit_missing.load(Ordering::Relaxed) {
            self.forget_missing_read_audit(database);
        }
    }

    #[cold]
    fn forget_missing_read_audit(&self, database: &str) {
        let mut map = self
            .read_audit
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if map
            .get(database)
            .is_some_and(|(_, known)| *known == ReadAuditKnown::NoFunction)
        {
            map.remove(database);
        }
        if !map.values().any(|(_, k)| *k == ReadAuditKnown::NoFunction) {
            self.read_audit_missing.store(false, Ordering::Relaxed);
        }
    }

    /// Remembers where the configuration comes from, so that it can be reloaded.
    pub fn set_source(&self, source: Source) {
        *self.source.lock().unwrap_or_else(PoisonError::into_inner) = Some(source);
    }

    /// Reads the configuration again and puts it in force for new sessions. A file that
    /// does not read or validate leaves the old configuration in force.
    pub fn reload(&self) -> Result<(), String> {
        let source = self
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(source) = source else {
            return Err(
                "pgfence was started without a configuration file: nothing to reload".into(),
            );
        };
        let new = match source.load() {
            Ok(c) => c,
            Err(e) => {
                // As a string field: quoted, its newlines (a TOML error's excerpt) escaped.
                warn!(
                    error = e.to_string().as_str(),
                    "reload failed: the previous configuration stays in force"
                );
                return Err(format!(
                    "reload failed, the previous configuration stays in force: {e}"
                ));
            }
        };
        let old = self.config();
        let restart_only = old.restart_only_changes(&new);
        if !restart_only.is_empty() {
            warn!(
                settings = restart_only.join(", ").as_str(),
                "reload: these settings only change at restart; they keep their old values"
            );
        }
        let mut new = new;
        // Keep what cannot change live.
        new.listen = old.listen;
        new.unix_socket_dir = old.unix_socket_dir.clone();
        new.telemetry.metrics_addr = old.telemetry.metrics_addr;
        new.telemetry.log_format = old.telemetry.log_format;
        new.fence.install = old.fence.install.clone();
        if let Err(e) = self.set_config(Arc::new(new)) {
            warn!(
                error = e.to_string().as_str(),
                "reload failed: the previous configuration stays in force"
            );
            return Err(format!(
                "reload failed, the previous configuration stays in force: {e}"
            ));
        }
        let config_file = source.path.as_deref().map_or_else(
            || "(none: options only)".into(),
            |p| p.display().to_string(),
        );
        info!(
            config_file = config_file.as_str(),
            "configuration reloaded: new sessions use it"
        );
        Ok(())
    }

    /// Counts a new session (including ones still starting up).
    pub fn enter(&self) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.metrics.client_connections.inc();
        ActiveGuard(self.active.clone(), self.metrics.clone())
    }

    /// The server refused a login for lack of connection slots, perhaps held by kept idle
    /// connections: closes them (logged at WARN) so that the slots come free. Returns how
    /// many it closed.
    pub fn free_server_slots(&self) -> usize {
        let closed = self.pool.clear();
        if closed > 0 {
            tracing::warn!(
                closed,
                "the server refused a login for lack of connection slots: \
                 closed the idle server connections pgfence kept"
            );
        }
        closed
    }

    /// Counts an upstream failure.
    pub fn upstream_error(&self) {
        Stats::add(&self.stats.upstream_errors);
        self.metrics.upstream_errors.inc();
    }

    /// Sessions alive now.
    pub fn active_sessions(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// `Some(limit)` when this session is one too many.
    pub fn too_many_clients(&self, config: &Config) -> Option<usize> {
        let limit = config.limits.max_client_connections;
        (self.active_sessions() > limit).then_some(limit)
    }

    /// The configuration new sessions use.
    pub fn config(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts a new configuration in force for new sessions, with the TLS certificate and
    /// key its files hold now. A certificate or key that cannot be used changes nothing.
    pub fn set_config(&self, config: Arc<Config>) -> Result<(), String> {
        let tls = TlsConfigs::new(&config)?;
        *self.tls.write().unwrap_or_else(PoisonError::into_inner) = tls;
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = config;
        Ok(())
    }

    /// The TLS configuration new clients get, `None` when TLS is declined.
    pub fn client_tls(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.tls
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .client
            .clone()
    }

    /// The TLS configuration of new server connections, `None` for plain ones.
    pub fn upstream_tls(&self) -> Option<Arc<rustls::ClientConfig>> {
        self.tls
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .upstream
            .clone()
    }

    /// A process-unique id for a client session.
    pub fn next_client_id(&self) -> u64 {
        self.next_client_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Keeps a rejection for `SHOW REJECTIONS`.
    pub fn remember_rejection(&self, record: RejectionRecord) {
        let mut log = self
            .rejections
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if log.len() == REJECTIONS_KEPT {
            log.pop_front();
        }
        log.push_back(record);
    }
}

/// rustls' side of the configuration: for clients (`client_tls`) and for the server
/// (`upstream.sslmode`); `None` where TLS is not used.
#[derive(Debug)]
struct TlsConfigs {
    client: Option<Arc<rustls::ServerConfig>>,
    upstream: Option<Arc<rustls::ClientConfig>>,
}

impl TlsConfigs {
    fn new(config: &Config) -> Result<TlsConfigs, String> {
        Ok(TlsConfigs {
            client: crate::tls::acceptor(&config.client_tls)?,
            upstream: crate::tls::connector(&config.upstream)?,
        })
    }
}

/// The highest token pgfence has seen accepted, per database and resource: each database
/// holds its own fences (a resource written in two databases has two). Only ever grows; the
/// database stays the authority (the fast path may reject with it, never accept).
#[derive(Debug, Default)]
pub struct KnownFences {
    databases: DashMap<String, Arc<DatabaseFences>>,
}

impl KnownFences {
    /// The fences of `database`. A session looks them up once, after its login (a database
    /// is only added by a session that reached the server).
    pub fn of(&self, database: &str) -> Arc<DatabaseFences> {
        if let Some(fences) = self.databases.get(database) {
            return fences.clone();
        }
        self.databases
            .entry(database.to_string())
            .or_default()
            .clone()
    }
}

/// The highest token pgfence has seen accepted, per resource, in one database.
#[derive(Debug, Default)]
pub struct DatabaseFences {
    map: DashMap<String, i64>,
}

impl DatabaseFences {
    /// Records that `token` was accepted (or is the fence) for `resource`.
    pub fn observe(&self, resource: &str, token: i64) {
        if let Some(mut cur) = self.map.get_mut(resource) {
            if *cur < token {
                *cur = token;
            }
            return;
        }
        self.map
            .entry(resource.to_string())
            .and_modify(|cur| *cur = (*cur).max(token))
            .or_insert(token);
    }

    /// The highest token seen for `resource`.
    pub fn get(&self, resource: &str) -> Option<i64> {
        self.map.get(resource).map(|v| *v)
    }
}

/// One rejected transaction, as `SHOW REJECTIONS` and the log show it.
#[derive(Debug, Clone)]
pub struct RejectionRecord {
    pub at: SystemTime,
    pub resource: String,
    pub token: String,
    pub fence: Option<i64>,
    pub reason: &'static str,
    pub path: &'static str,
    pub client_addr: String,
    pub user: String,
    pub database: String,
    pub application_name: String,
    pub backend_pid: i32,
    pub statement: String,
}

/// A connected client, for `SHOW CLIENTS`.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub addr: String,
    /// TLS protocol and cipher suite (`TLSv1_3/TLS13_AES_256_GCM_SHA384`), if any.
    pub tls: Option<String>,
    /// The common name of the client's TLS certificate, if it sent one.
    pub certificate_cn: Option<String>,
    pub user: String,
    pub database: String,
    pub application_name: String,
    pub backend_pid: i32,
    pub connected_at: SystemTime,
    /// Ends the session (`KILL_CLIENT`).
    pub(crate) stop: crate::session::Stop,
}

/// Process-wide counters (`SHOW STATS`, metrics).
#[derive(Debug, Default)]
pub struct Stats {
    pub clients_total: AtomicU64,
    /// Counted at every query by every worker thread: sharded (see [`crate::sharded`]).
    pub queries: crate::sharded::Counter,
    pub checks: crate::sharded::Counter,
    pub rejections: AtomicU64,
    pub fast_rejections: AtomicU64,
    pub upstream_errors: AtomicU64,
    /// `pgfence.reads_may_write(9)` asked: at sessions' starts, and again by sessions whose
    /// answer is out of date (see `session::read_audit`).
    pub read_audit_questions: AtomicU64,
}

impl Stats {
    pub fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
