//! Child processes: running a program to its end, keeping a server (pgfence, PgBouncer) up
//! for the length of the run, and stopping everything on Ctrl-C.
//!
//! Every child gets its own process group, so a Ctrl-C at the terminal reaches only the
//! runner, which then stops its children in order (clients, proxies, PostgreSQL) and
//! removes its directory. The signal is noticed by a helper thread that sets a flag; every
//! wait in this module polls that flag.

use std::collections::VecDeque;
use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::unistd::{Gid, Uid, User};

use crate::error::{Error, Result};

/// Set by the signal thread; read by every wait.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// How often waits look at their child and at [`INTERRUPTED`].
const POLL: Duration = Duration::from_millis(20);

/// The address every server started here listens on.
pub const HOST: &str = "127.0.0.1";

/// Catches SIGINT, SIGTERM and SIGHUP on a helper thread from now on.
pub fn watch_signals() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let io = |source| Error::Spawn {
        program: "the signal-handling thread".to_string(),
        source,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io)?;
    // Registered here, before returning, so that no early signal is missed.
    let (mut int, mut term, mut hup) = {
        let _guard = rt.enter();
        (
            signal(SignalKind::interrupt()).map_err(io)?,
            signal(SignalKind::terminate()).map_err(io)?,
            signal(SignalKind::hangup()).map_err(io)?,
        )
    };
    thread::Builder::new()
        .name("signals".to_string())
        .spawn(move || {
            rt.block_on(async move {
                loop {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                        _ = hup.recv() => {}
                    }
                    if INTERRUPTED.swap(true, Ordering::SeqCst) {
                        eprintln!("pgfence-bench: still cleaning up, please wait");
                    } else {
                        eprintln!("pgfence-bench: interrupted, stopping what was started");
                    }
                }
            })
        })
        .map_err(io)?;
    Ok(())
}

/// `Err(Interrupted)` once a signal arrived.
pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(Error::Interrupted)
    } else {
        Ok(())
    }
}

/// Sleeps `d`, waking early (with `Err`) on a signal.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupted()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        thread::sleep(POLL.min(end - now));
    }
}

/// The OS user servers run as when the runner runs as root (`initdb`, `postgres` and
/// `pgbouncer` refuse root).
#[derive(Debug, Clone, Copy)]
pub struct ServerUser {
    pub uid: Uid,
    pub gid: Gid,
}

impl ServerUser {
    /// `Some(postgres)` as root, `None` (run servers as ourselves) otherwise.
    pub fn detect() -> Result<Option<ServerUser>> {
        if !Uid::effective().is_root() {
            return Ok(None);
        }
        match User::from_name("postgres") {
            Ok(Some(u)) => Ok(Some(ServerUser {
                uid: u.uid,
                gid: u.gid,
            })),
            _ => Err(Error::MissingTool {
                program: "OS user `postgres`",
                hint: "as root, the runner starts PostgreSQL and PgBouncer as the `postgres` OS \
                       user; install the postgresql package (scripts/install-deps.sh) or run \
                       as an ordinary user",
            }),
        }
    }

    /// Makes `path` the server user's (a directory it must write to, a file it must read).
    pub fn give(owner: Option<ServerUser>, path: &Path) -> Result<()> {
        if let Some(o) = owner {
            std::os::unix::fs::chown(path, Some(o.uid.as_raw()), Some(o.gid.as_raw()))
                .map_err(Error::io("chown to postgres", path))?;
        }
        Ok(())
    }
}

/// A command in its own process group, with the libpq variables that would override the
/// runner's choices removed; run as `owner` when given.
pub fn command(program: &Path, owner: Option<ServerUser>) -> Command {
    let mut cmd = Command::new(program);
    cmd.process_group(0);
    for var in [
        "PGDATA",
        "PGPORT",
        "PGHOST",
        "PGHOSTADDR",
        "PGOPTIONS",
        "PGUSER",
        "PGDATABASE",
        "PGSERVICE",
        "PGSSLMODE",
        "RUST_LOG",
    ] {
        cmd.env_remove(var);
    }
    if let Some(o) = owner {
        cmd.uid(o.uid.as_raw()).gid(o.gid.as_raw());
        // The postgres user may not be able to enter root's home or working directory.
        cmd.current_dir("/").env("HOME", "/tmp");
    }
    cmd
}

/// What a finished child printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Turns a failure into [`Error::Failed`] with the end of the output.
    pub fn ok_or(self, what: &str, hint: Option<&'static str>) -> Result<Output> {
        if self.status.success() {
            return Ok(self);
        }
        Err(Error::Failed {
            what: what.to_string(),
            status: self.status.to_string(),
            output: tail(&format!("{}{}", self.stdout, self.stderr), 40),
            hint,
        })
    }
}

/// Runs `cmd` to its end, capturing its output. Killed (and `Err`) at `timeout` or on a
/// signal.
pub fn run(cmd: &mut Command, what: &str, timeout: Duration) -> Result<Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| spawn_error(cmd, source))?;
    let stdout = child.stdout.take().map(reader);
    let stderr = child.stderr.take().map(reader);
    let status = wait(&mut child, timeout);
    let collect = |h: Option<thread::JoinHandle<Vec<u8>>>| {
        h.and_then(|h| h.join().ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    let (stdout, stderr) = (collect(stdout), collect(stderr));
    match status {
        Waited::Exited(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        Waited::Interrupted => Err(Error::Interrupted),
        Waited::TimedOut => Err(Error::Failed {
            what: what.to_string(),
            status: format!("killed after {timeout:?}"),
            output: tail(&format!("{stdout}{stderr}"), 40),
            hint: None,
        }),
    }
}

fn spawn_error(cmd: &Command, source: std::io::Error) -> Error {
    Error::Spawn {
        program: cmd.get_program().to_string_lossy().into_owned(),
        source,
    }
}

enum Waited {
    Exited(ExitStatus),
    TimedOut,
    Interrupted,
}

/// Waits for `child`, killing it at `timeout` or on a signal.
fn wait(child: &mut Child, timeout: Duration) -> Waited {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Waited::Exited(status);
        }
        let outcome = if check_interrupted().is_err() {
            Waited::Interrupted
        } else if Instant::now() >= deadline {
            Waited::TimedOut
        } else {
            thread::sleep(POLL);
            continue;
        };
        let _ = child.kill();
        let _ = child.wait();
        return outcome;
    }
}

fn reader(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The last [`LOG_KEEP`] bytes a server printed. A ring, not a file: pgfence logs every
/// rejection, and the stale writer makes tens of thousands a second.
#[derive(Debug, Clone, Default)]
struct LogTail(Arc<Mutex<VecDeque<u8>>>);

/// How much of a server's output is kept for error messages.
const LOG_KEEP: usize = 32 * 1024;

impl LogTail {
    /// Copies `pipe` into the ring until it closes.
    fn follow(&self, mut pipe: impl Read + Send + 'static) {
        let ring = self.0.clone();
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut ring = ring.lock().unwrap_or_else(|e| e.into_inner());
                ring.extend(&buf[..n]);
                let excess = ring.len().saturating_sub(LOG_KEEP);
                ring.drain(..excess);
            }
        });
    }

    fn text(&self) -> String {
        let ring = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let bytes: Vec<u8> = ring.iter().copied().collect();
        tail(&String::from_utf8_lossy(&bytes), 30)
    }
}

/// A server process (pgfence, PgBouncer) that runs until dropped, the end of its output
/// kept for error messages.
#[derive(Debug)]
pub struct Daemon {
    what: String,
    child: Child,
    log: LogTail,
    port: u16,
}

impl Daemon {
    /// Starts `cmd` and waits until it accepts TCP connections on `port` (at most
    /// `ready_within`).
    pub fn start(
        mut cmd: Command,
        what: &str,
        port: u16,
        ready_within: Duration,
    ) -> Result<Daemon> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| spawn_error(&cmd, source))?;
        let log = LogTail::default();
        if let Some(out) = child.stdout.take() {
            log.follow(out);
        }
        if let Some(err) = child.stderr.take() {
            log.follow(err);
        }
        let mut daemon = Daemon {
            what: what.to_string(),
            child,
            log,
            port,
        };
        let deadline = Instant::now() + ready_within;
        loop {
            daemon.ensure_running()?;
            if TcpStream::connect((HOST, port)).is_ok() {
                return Ok(daemon);
            }
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    what: daemon.what.clone(),
                    port,
                    waited: ready_within,
                    log: daemon.log.text(),
                });
            }
            sleep(POLL)?;
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Err` when it has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        let status = match self.child.try_wait() {
            Ok(None) => return Ok(()),
            Ok(Some(status)) => status.to_string(),
            Err(e) => e.to_string(),
        };
        // Let the reader threads catch the last words.
        thread::sleep(POLL);
        Err(Error::Died {
            what: self.what.clone(),
            status,
            log: self.log.text(),
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Nothing of these servers needs a clean shutdown: they are throwaway.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ports picked from below Linux's ephemeral range (32768..61000), where the local ends of
/// the many client connections on a busy machine could take a port between the pick and
/// the server's bind.
const PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A TCP port on 127.0.0.1 that nothing listens on now, different from `taken`.
pub fn free_port(taken: &[u16]) -> u16 {
    let span = u32::from(PORTS.end - PORTS.start);
    let seed = std::process::id()
        .wrapping_mul(2_654_435_761)
        .wrapping_add(Instant::now().elapsed().subsec_nanos())
        .wrapping_add(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0),
        );
    for i in 0..span {
        let port = PORTS.start + ((seed.wrapping_add(i.wrapping_mul(7919))) % span) as u16;
        if !taken.contains(&port) && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(PORTS.start)
}
