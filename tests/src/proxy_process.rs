//! [`ProxyProcess`]: the real `pgfence` binary as a child process, for what an in-process
//! [`crate::Proxy`] cannot show: signals (SIGSTOP a proxy, SIGTERM drain), exit codes, the
//! log lines an operator reads, command-line flags.
//!
//! The binary is looked up next to the test executable (`target/<profile>/pgfence`), or at
//! env `PGFENCE_BIN`. `cargo test` does not build it for this crate: `scripts/test.sh`
//! runs `cargo build -p pgfence` first.
//!
//! Arguments may contain placeholders, replaced before the process starts:
//! `{port}` (the port picked for it), `{listen}` (`127.0.0.1:<port>`), `{config}` (the path
//! of the TOML file written from [`ProxyProcessBuilder::config`]). The environment also gets
//! `PGFENCE_LISTEN=127.0.0.1:<port>` and `NO_COLOR=1`.
//!
//! Each process gets a directory `<tmp>/pgfence-proc-<test pid>-XXXXXX` (config, output,
//! and a file `child` naming the process). A process is killed on drop; one left running
//! by a test process that died without unwinding (SIGKILL, a timeout) is killed, and its
//! directory removed, by the next test process that starts one.

use std::fs;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Once;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pgfence_config::Config;
use tempfile::TempDir;

use crate::client::{connect_to, connstr, psql_command, run_psql};
use crate::cluster::{pg_bin_dir, PgCluster, SUPERUSER};
use crate::ports::free_port;

/// The flag [`ProxyProcess::for_cluster`] passes the config file with.
pub const CONFIG_FLAG: &str = "--config";
/// How often a start is retried after losing the race for its port.
const START_ATTEMPTS: usize = 3;
/// The start of a process directory's name; the test process's pid follows.
const DIR_PREFIX: &str = "pgfence-proc-";
/// The file in a process directory that names the process: pid and start time.
const CHILD_FILE: &str = "child";

/// Options for a [`ProxyProcess`].
#[derive(Debug, Clone)]
pub struct ProxyProcessBuilder {
    program: Option<PathBuf>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    config: Option<Config>,
    ready_timeout: Duration,
}

impl Default for ProxyProcessBuilder {
    fn default() -> Self {
        ProxyProcessBuilder {
            program: None,
            args: Vec::new(),
            env: Vec::new(),
            config: None,
            ready_timeout: Duration::from_secs(30),
        }
    }
}

impl ProxyProcessBuilder {
    /// Runs another program instead of `pgfence` (an older build, or the harness's
    /// self-test).
    pub fn program(mut self, path: impl Into<PathBuf>) -> Self {
        self.program = Some(path.into());
        self
    }

    /// Adds an argument (placeholders allowed).
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments (placeholders allowed).
    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable of the process (`RUST_LOG`, ...).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Writes `config` (with `listen` set to the picked port) to a TOML file, whose path
    /// replaces `{config}` in the arguments.
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// How long the port may take to accept connections. Default 30 s.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Starts the process and waits until its port accepts TCP connections. Panics with the
    /// process's output when it exits or times out first.
    pub fn start(self) -> ProxyProcess {
        let program = self.program.clone().unwrap_or_else(ProxyProcess::binary);
        sweep_orphaned_proxies();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("create a directory for the proxy's log and config");
        let mut last_log = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port();
            match self.try_start(&program, &dir, port) {
                Ok(child) => {
                    return ProxyProcess {
                        child,
                        port,
                        dir,
                        program,
                    }
                }
                Err(Failure::PortTaken(log)) => last_log = log,
                Err(Failure::Other(why)) => panic!("{} {why}", program.display()),
            }
        }
        panic!(
            "{}: no free port after {START_ATTEMPTS} attempts:\n{last_log}",
            program.display()
        );
    }

    fn try_start(&self, program: &Path, dir: &TempDir, port: u16) -> Result<Child, Failure> {
        let listen = format!("{}:{port}", crate::HOST);
        let config_path = dir.path().join("pgfence.toml");
        if let Some(config) = &self.config {
            let mut config = config.clone();
            config.listen = listen.parse().expect("parse 127.0.0.1:<port>");
            let text = toml::to_string(&config).expect("serialize the proxy config to TOML");
            fs::write(&config_path, text).expect("write the proxy config file");
        }
        let log_path = dir.path().join("output.log");
        let log = fs::File::create(&log_path).expect("create the proxy's log file");
        let log_err = log.try_clone().expect("clone the proxy's log file handle");
        let substitute = |arg: &String| {
            arg.replace("{port}", &port.to_string())
                .replace("{listen}", &listen)
                .replace("{config}", &config_path.to_string_lossy())
        };
        let mut cmd = Command::new(program);
        cmd.args(self.args.iter().map(substitute))
            .env("PGFENCE_LISTEN", &listen)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Failure::Other(format!("could not be started: {e}")))?;
        if let Some(started) = start_time(child.id()) {
            let named = format!("{} {started}", child.id());
            fs::write(dir.path().join(CHILD_FILE), named).expect("write the proxy's pid file");
        }

        let read_log = || {
            fs::read(&log_path)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if TcpStream::connect_timeout(
                &SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_secs(1),
            )
            .is_ok()
            {
                return Ok(child);
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log = read_log();
                if log.contains("Address already in use") || log.contains("AddrInUse") {
                    return Err(Failure::PortTaken(log));
                }
                return Err(Failure::Other(format!(
                    "exited ({status}) before listening on {listen}:\n{log}"
                )));
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Failure::Other(format!(
                    "did not listen on {listen} within {:?}:\n{}",
                    self.ready_timeout,
                    read_log()
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

enum Failure {
    PortTaken(String),
    Other(String),
}

/// When process `pid` started (field 22 of `/proc/<pid>/stat`, in clock ticks since boot),
/// which tells it from a later process given the same pid.
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, field 2, is in parentheses and may hold spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Kills the `pgfence` processes that test processes since gone left running, and removes
/// their directories (once per test process).
fn sweep_orphaned_proxies() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let tmp = std::env::temp_dir();
        for dir in crate::host::orphaned_dirs(&[tmp.as_path()], DIR_PREFIX) {
            let child = fs::read_to_string(dir.join(CHILD_FILE)).unwrap_or_default();
            let mut fields = child.split_whitespace();
            let pid = fields.next().and_then(|f| f.parse::<u32>().ok());
            let started = fields.next().and_then(|f| f.parse::<u64>().ok());
            if let (Some(pid @ 1..), Some(started)) = (pid, started) {
                if start_time(pid) == Some(started) {
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                    eprintln!(
                        "harness: killed an orphaned pgfence (pid {pid}) of {}",
                        dir.display()
                    );
                }
            }
            let _ = fs::remove_dir_all(&dir);
        }
    });
}

/// A running `pgfence` process. Killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct ProxyProcess {
    child: Child,
    port: u16,
    program: PathBuf,
    /// Log and config file; removed on drop.
    dir: TempDir,
}

impl ProxyProcess {
    /// Options for a process.
    pub fn builder() -> ProxyProcessBuilder {
        ProxyProcessBuilder::default()
    }

    /// Starts `pgfence` with `args` (placeholders allowed, e.g. `--listen {listen}`).
    pub fn start(args: &[&str]) -> ProxyProcess {
        ProxyProcess::builder().args(args.iter().copied()).start()
    }

    /// Starts `pgfence --config <file> <extra_args>` with [`crate::Proxy::config_for`]
    /// `(cluster)` in the file.
    pub fn for_cluster(cluster: &PgCluster, extra_args: &[&str]) -> ProxyProcess {
        ProxyProcess::builder()
            .config(crate::Proxy::config_for(cluster))
            .args([CONFIG_FLAG, "{config}"])
            .args(extra_args.iter().copied())
            .start()
    }

    /// The `pgfence` binary: env `PGFENCE_BIN`, else `target/<profile>/pgfence` next to the
    /// running test executable (`target/<profile>/deps/<test>`).
    pub fn binary() -> PathBuf {
        if let Some(path) = std::env::var_os("PGFENCE_BIN") {
            return PathBuf::from(path);
        }
        let exe = std::env::current_exe().expect("path of the running test executable");
        let profile_dir = exe
            .parent()
            .filter(|d| d.ends_with("deps"))
            .and_then(Path::parent)
            .or_else(|| exe.parent())
            .expect("directory of the test executable");
        let bin = profile_dir.join("pgfence");
        if !bin.is_file() {
            panic!(
                "the pgfence binary is missing at {}: run `cargo build -p pgfence` first \
                 (scripts/test.sh does), or set PGFENCE_BIN",
                bin.display()
            );
        }
        bin
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port it listens on (at 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A key=value connection string for `db` through this proxy, as `postgres`.
    pub fn connstr(&self, db: &str) -> String {
        connstr(self.port, db, SUPERUSER, None)
    }

    /// A key=value connection string for `db` through this proxy, as `user`.
    pub fn connstr_as(&self, db: &str, user: &str, password: Option<&str>) -> String {
        connstr(self.port, db, user, password)
    }

    /// A tokio-postgres client through this proxy (inside a tokio runtime).
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        connect_to(&self.connstr(db)).await
    }

    /// Like [`PgCluster::psql`], through this proxy.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        run_psql(self.psql_cmd(), db, sql)
    }

    /// `psql -X -h 127.0.0.1 -p <port> -U postgres`, to add arguments to.
    pub fn psql_cmd(&self) -> Command {
        psql_command(pg_bin_dir(), self.port)
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn logs(&self) -> String {
        fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The file stdout and stderr go to.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("output.log")
    }

    /// The config file written from [`ProxyProcessBuilder::config`], if any.
    pub fn config_path(&self) -> Option<PathBuf> {
        Some(self.dir.path().join("pgfence.toml")).filter(|p| p.is_file())
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, SIGTERM, SIGHUP, ...).
    pub fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.pid()).expect("pid fits in i32"));
        kill(pid, signal).unwrap_or_else(|e| panic!("kill -{signal} {}: {e}", self.pid()));
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() >= deadline => return None,
                Ok(None) => thread::sleep(Duration::from_millis(10)),
                Err(e) => panic!("waiting for {}: {e}", self.program.display()),
            }
        }
    }

    /// The exit status, if it exited.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("poll the proxy process")
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
