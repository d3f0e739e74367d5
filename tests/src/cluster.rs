//! [`PgCluster`]: a throwaway PostgreSQL server for one test.
//!
//! Each cluster gets its own directory `<root>/pgfence-pg-<test pid>-XXXXXX` (data directory,
//! unix socket directory, server log), its own port on 127.0.0.1, and is initialised with:
//!
//! - superuser `postgres`, trusted on TCP and the unix socket;
//! - `md5user` / `md5pass`, stored as an MD5 hash and required to log in with `md5`;
//! - `scramuser` / `scrampass`, stored as SCRAM and required to log in with `scram-sha-256`;
//! - database `app`, whose schema `public` every role may create in;
//! - settings for tests (`max_connections = 300`, `track_commit_timestamp = on`,
//!   `max_prepared_transactions = 10`) and for speed (no fsync, no full page writes).
//!
//! `<root>` is `/dev/shm` when it is a tmpfs with room (copying a data directory there
//! takes a tenth of the time it takes on this machine's disk), else `/tmp`; env
//! `PGFENCE_TEST_TMPDIR` overrides it. Both are world-traversable (sticky 1777).
//!
//! **Running as root** (CI does): `initdb` refuses root, so the directory is handed to the
//! `postgres` OS user (created by Debian's postgresql package) and `initdb`, `pg_ctl` and
//! hence the server run as that user (`setuid`/`setgid` on the child). Clients (psql, the
//! tests themselves) stay root: they only talk TCP.
//!
//! `initdb` and the setup run once per test process, into a template cluster that is then
//! stopped; every cluster is a copy of its data directory (about 0.2 s to a running server,
//! against 1.5 s for `initdb` and setup on this machine).
//!
//! A cluster is stopped (`pg_ctl stop -m immediate`) and its directory removed on drop. The
//! template, and the clusters of a test process that dies without unwinding, are left
//! behind; the next test process that starts a cluster stops and removes them.

use std::fs;
use std::io::Write;
use std::os::unix::fs::chown;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tempfile::TempDir;

use crate::client::{client_command, connect_to, connstr, psql_command, run_psql};
use crate::host::{
    cluster_root, pg_ctl_stop, server_command, server_user, sweep_orphans, ServerUser, DIR_PREFIX,
    PG_CTL_WAIT_SECS,
};
use crate::ports::free_port;
use crate::process;

pub use crate::host::pg_bin_dir;

/// The superuser every cluster is created with; trusted, no password.
pub const SUPERUSER: &str = "postgres";
/// A role that must log in with `md5` password authentication.
pub const MD5_USER: &str = "md5user";
/// The password of [`MD5_USER`].
pub const MD5_PASSWORD: &str = "md5pass";
/// A role that must log in with SCRAM-SHA-256.
pub const SCRAM_USER: &str = "scramuser";
/// The password of [`SCRAM_USER`].
pub const SCRAM_PASSWORD: &str = "scrampass";
/// The database tests use for their tables.
pub const APP_DB: &str = "app";

/// How often a start is retried after losing the race for its port.
const START_ATTEMPTS: usize = 5;
const BASE_SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "'127.0.0.1'"),
    ("max_connections", "300"),
    ("track_commit_timestamp", "on"),
    ("max_prepared_transactions", "10"),
    ("fsync", "off"),
    ("synchronous_commit", "off"),
    ("full_page_writes", "off"),
    ("log_min_messages", "warning"),
];

const PG_HBA: &str = "\
# Written by the pgfence test harness.
local all md5user                 md5
local all scramuser               scram-sha-256
local all all                     trust
host  all md5user   127.0.0.1/32  md5
host  all scramuser 127.0.0.1/32  scram-sha-256
host  all all       127.0.0.1/32  trust
local replication all             trust
host  replication all 127.0.0.1/32  trust
";

const SETUP_SQL: &str = "\
SET password_encryption = 'md5';
CREATE ROLE md5user LOGIN PASSWORD 'md5pass';
SET password_encryption = 'scram-sha-256';
CREATE ROLE scramuser LOGIN PASSWORD 'scrampass';
CREATE DATABASE app;
";

const APP_SETUP_SQL: &str = "GRANT ALL ON SCHEMA public TO PUBLIC;";

/// Options for a [`PgCluster`]; [`PgCluster::start`] uses the defaults.
#[derive(Debug, Default, Clone)]
pub struct PgClusterBuilder {
    settings: Vec<(String, String)>,
}

impl PgClusterBuilder {
    /// Adds a `postgresql.conf` line `name = value` after the harness's own settings (so it
    /// wins). `value` is written as is: quote strings yourself (`"'ddl'"`).
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    /// Creates and starts the cluster. Blocking; fine to call from async tests.
    pub fn start(self) -> PgCluster {
        sweep_orphans();
        let template = template();
        let mut cluster = PgCluster::create_dir("");
        let mut cp = cluster.server_command_at(Path::new("cp"));
        cp.arg("-a")
            .arg(template.data_dir())
            .arg(cluster.data_dir());
        let out = process::run(&mut cp, None, Duration::from_secs(120));
        if !out.success() {
            panic!(
                "copying the template data directory failed ({}):\n{}",
                out.describe(),
                out.stderr
            );
        }
        let socket = format!("'{}'", cluster.socket_dir().display());
        let own = [("unix_socket_directories".to_string(), socket)];
        cluster.append_settings(own.into_iter().chain(self.settings));
        cluster.start_on_free_port();
        cluster
    }
}

/// The cluster every cluster of this process is copied from: initialised, configured and
/// set up once, then stopped. A copy of a data directory takes a tenth of the time of
/// `initdb` (which boots the server several times to probe settings). Never dropped: its
/// directory outlives the process and is removed by the next process's orphan sweep.
fn template() -> &'static PgCluster {
    static TEMPLATE: OnceLock<PgCluster> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let mut cluster = PgCluster::create_dir("template-");
        cluster.initdb();
        let socket = format!("'{}'", cluster.socket_dir().display());
        let base = BASE_SETTINGS
            .iter()
            .map(|&(k, v)| (k.to_string(), v.to_string()));
        cluster.append_settings(base.chain([("unix_socket_directories".to_string(), socket)]));
        fs::write(cluster.data_dir().join("pg_hba.conf"), PG_HBA).expect("write pg_hba.conf");
        cluster.start_on_free_port();
        cluster.psql("postgres", SETUP_SQL);
        cluster.psql(APP_DB, APP_SETUP_SQL);
        // A clean shutdown, so that copies start without crash recovery.
        cluster.stop_server();
        cluster
    })
}

/// A running PostgreSQL server owned by one test. Stopped and deleted on drop.
#[derive(Debug)]
pub struct PgCluster {
    bin_dir: PathBuf,
    owner: Option<ServerUser>,
    port: u16,
    /// Whether the harness believes the server is up, so drop does not stop it twice.
    running: bool,
    /// Declared last: removed after `Drop::drop` stopped the server.
    dir: TempDir,
}

impl PgCluster {
    /// Starts a cluster with the default options. Blocking; fine to call from async tests.
    pub fn start() -> PgCluster {
        PgCluster::builder().start()
    }

    /// Options for a cluster.
    pub fn builder() -> PgClusterBuilder {
        PgClusterBuilder::default()
    }

    /// The TCP port the server listens on (at 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `"127.0.0.1"`.
    pub fn host(&self) -> &'static str {
        crate::HOST
    }

    /// The directory with the server binaries, psql and pgbench.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The cluster's own directory (data, socket, log); gone after drop.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The directory of the server's unix socket (`host=` for a unix-socket connection).
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.path().join("sock")
    }

    /// The server's log so far (warnings and errors only, by `log_min_messages`).
    pub fn server_log(&self) -> String {
        fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// A key=value connection string for `db` as the superuser `postgres`.
    pub fn connstr(&self, db: &str) -> String {
        connstr(self.port, db, SUPERUSER, None)
    }

    /// A key=value connection string for `db` as `user`, with `password` when given.
    pub fn connstr_as(&self, db: &str, user: &str, password: Option<&str>) -> String {
        connstr(self.port, db, user, password)
    }

    /// A tokio-postgres client for `db` as `postgres`; the connection runs on a spawned
    /// task, so call this inside a tokio runtime.
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        connect_to(&self.connstr(db)).await
    }

    /// Runs `sql` (any number of statements, psql meta-commands allowed) with
    /// `psql -X -Atq -v ON_ERROR_STOP=1` on `db` as `postgres`, returning its output;
    /// panics with psql's errors when it fails.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        run_psql(self.psql_cmd(), db, sql)
    }

    /// `psql -X -h 127.0.0.1 -p <port> -U postgres`, to add arguments to.
    pub fn psql_cmd(&self) -> Command {
        psql_command(&self.bin_dir, self.port)
    }

    /// `pgbench -h 127.0.0.1 -p <port> -U postgres`, to add arguments (and the database) to.
    pub fn pgbench_cmd(&self) -> Command {
        client_command(&self.bin_dir.join("pgbench"), self.port)
    }

    /// Turns TLS on in the running server with `cert` and `key` (PEM files, copied into the
    /// data directory, owned by the server's OS user, the key readable by it alone, as
    /// PostgreSQL requires) and reloads it.
    pub fn enable_ssl(&self, cert: &Path, key: &Path) {
        use std::os::unix::fs::PermissionsExt;
        let (cert_copy, key_copy) = (
            self.data_dir().join("server.crt"),
            self.data_dir().join("server.key"),
        );
        fs::copy(cert, &cert_copy).expect("copy the server certificate");
        fs::copy(key, &key_copy).expect("copy the server key");
        fs::set_permissions(&key_copy, fs::Permissions::from_mode(0o600))
            .expect("chmod 600 the server key");
        if let Some(o) = self.owner {
            for path in [&cert_copy, &key_copy] {
                chown(path, Some(o.uid.as_raw()), Some(o.gid.as_raw()))
                    .unwrap_or_else(|e| panic!("chown {} to postgres: {e}", path.display()));
            }
        }
        self.append_settings([
            ("ssl".to_string(), "on".to_string()),
            ("ssl_cert_file".to_string(), "'server.crt'".to_string()),
            ("ssl_key_file".to_string(), "'server.key'".to_string()),
        ]);
        self.psql("postgres", "SELECT pg_reload_conf()");
        let start = std::time::Instant::now();
        while self.psql("postgres", "SHOW ssl").trim() != "on" {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "ssl did not turn on:\n{}",
                self.server_log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Refuses TCP logins that do not use TLS (`hostnossl ... reject` before the harness's
    /// own lines) and reloads. Call after [`PgCluster::enable_ssl`]; psql's default
    /// `sslmode=prefer` still gets in.
    pub fn refuse_plain_tcp(&self) {
        self.hba_first("hostnossl all all 127.0.0.1/32 reject");
    }

    /// Requires a client certificate signed by a CA of `ca_file` from TLS logins over TCP to
    /// the database `app` (`hostssl app ... trust clientcert=verify-ca` before the harness's
    /// own lines), and reloads. Call after [`PgCluster::enable_ssl`]; [`PgCluster::psql`]
    /// still works on the other databases.
    pub fn require_client_certs(&self, ca_file: &Path) {
        let copy = self.data_dir().join("root.crt");
        fs::copy(ca_file, &copy).expect("copy the client CA");
        if let Some(o) = self.owner {
            chown(&copy, Some(o.uid.as_raw()), Some(o.gid.as_raw()))
                .unwrap_or_else(|e| panic!("chown {} to postgres: {e}", copy.display()));
        }
        self.append_settings([("ssl_ca_file".to_string(), "'root.crt'".to_string())]);
        self.hba_first(&format!(
            "hostssl {APP_DB} all 127.0.0.1/32 trust clientcert=verify-ca"
        ));
    }

    /// Puts `line` first in pg_hba.conf and reloads.
    fn hba_first(&self, line: &str) {
        let hba = self.data_dir().join("pg_hba.conf");
        let lines = fs::read_to_string(&hba).expect("read pg_hba.conf");
        fs::write(&hba, format!("{line}\n{lines}")).expect("write pg_hba.conf");
        self.psql("postgres", "SELECT pg_reload_conf()");
        // The postmaster reads pg_hba.conf on SIGHUP, before it takes the next connection.
        std::thread::sleep(Duration::from_millis(200));
    }

    /// Stops the server (`-m fast`), keeping its data; [`PgCluster::start_server`] starts it
    /// again on the same port. For tests of an upstream that goes away.
    pub fn stop_server(&mut self) {
        self.pg_ctl_stop("fast")
            .unwrap_or_else(|e| panic!("stopping the server: {e}"));
        self.running = false;
    }

    /// Starts a server stopped by [`PgCluster::stop_server`], on the same port.
    pub fn start_server(&mut self) {
        if let Err(log) = self.pg_ctl_start() {
            panic!("restarting the server on port {} failed:\n{log}", self.port);
        }
        self.running = true;
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// A command for a server program, run as the server's OS user in the cluster dir.
    fn server_command(&self, program: &str) -> Command {
        self.server_command_at(&self.bin_dir.join(program))
    }

    /// Any program, run as the server's OS user in the cluster dir.
    fn server_command_at(&self, program: &Path) -> Command {
        server_command(program, self.owner, self.dir.path())
    }

    /// An empty cluster directory `<root>/pgfence-pg-<pid>-<infix>XXXXXX` with its socket
    /// directory, owned by the server's OS user.
    fn create_dir(infix: &str) -> PgCluster {
        let owner = server_user();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-{infix}", std::process::id()))
            .tempdir_in(cluster_root())
            .unwrap_or_else(|e| {
                panic!(
                    "create a cluster directory in {}: {e}",
                    cluster_root().display()
                )
            });
        let socket_dir = dir.path().join("sock");
        fs::create_dir(&socket_dir).expect("create the cluster's socket directory");
        if let Some(o) = owner {
            for path in [dir.path(), socket_dir.as_path()] {
                chown(path, Some(o.uid.as_raw()), Some(o.gid.as_raw()))
                    .unwrap_or_else(|e| panic!("chown {} to postgres: {e}", path.display()));
            }
        }
        PgCluster {
            bin_dir: pg_bin_dir().to_path_buf(),
            owner,
            port: 0,
            running: false,
            dir,
        }
    }

    fn initdb(&self) {
        let mut cmd = self.server_command("initdb");
        cmd.arg("-D").arg(self.data_dir()).args([
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]);
        let out = process::run(&mut cmd, None, Duration::from_secs(120));
        if !out.success() {
            panic!(
                "initdb failed ({}):\n{}\n{}",
                out.describe(),
                out.stdout,
                out.stderr
            );
        }
    }

    /// Appends `name = value` lines to postgresql.conf; later lines win over earlier ones.
    fn append_settings(&self, settings: impl IntoIterator<Item = (String, String)>) {
        let mut lines = String::from("\n# Added by the pgfence test harness.\n");
        for (name, value) in settings {
            lines.push_str(&format!("{name} = {value}\n"));
        }
        fs::OpenOptions::new()
            .append(true)
            .open(self.data_dir().join("postgresql.conf"))
            .and_then(|mut conf| conf.write_all(lines.as_bytes()))
            .expect("append to postgresql.conf");
    }

    /// Starts the server, picking another port when the chosen one was taken meanwhile.
    fn start_on_free_port(&mut self) {
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            self.port = free_port();
            match self.pg_ctl_start() {
                Ok(()) => {
                    self.running = true;
                    return;
                }
                Err(log) if lost_port_race(&log) => last_log = log,
                Err(log) => panic!("PostgreSQL did not start on port {}:\n{log}", self.port),
            }
        }
        panic!("PostgreSQL did not start after {START_ATTEMPTS} ports were taken:\n{last_log}");
    }

    /// `pg_ctl start -w`; on failure, the server log and pg_ctl's output.
    fn pg_ctl_start(&self) -> Result<(), String> {
        let _ = fs::remove_file(self.log_path());
        let mut cmd = self.server_command("pg_ctl");
        cmd.arg("start")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", PG_CTL_WAIT_SECS, "-o"])
            .arg(format!("-p {}", self.port));
        let out = process::run(&mut cmd, None, Duration::from_secs(90));
        if out.success() {
            return Ok(());
        }
        // A server that is up but not ready in time would otherwise outlive the test.
        let _ = self.pg_ctl_stop("immediate");
        Err(format!(
            "pg_ctl start: {}\n{}{}\n--- server log ---\n{}",
            out.describe(),
            out.stdout,
            out.stderr,
            self.server_log()
        ))
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<(), String> {
        pg_ctl_stop(
            &self.bin_dir,
            self.owner,
            self.dir.path(),
            &self.data_dir(),
            mode,
        )
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.running {
            if let Err(e) = self.pg_ctl_stop("immediate") {
                eprintln!(
                    "harness: stopping the cluster on port {} failed: {e}",
                    self.port
                );
            }
        }
        // `dir` (a TempDir) is removed when the fields drop, right after this.
    }
}

/// True when a failed start's log says the port was taken by someone else.
fn lost_port_race(log: &str) -> bool {
    log.contains("Address already in use") || log.contains("could not bind")
}
