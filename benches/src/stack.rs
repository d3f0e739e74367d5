//! Everything a run starts: the work directory, the throwaway PostgreSQL (or the
//! `--upstream` one), pgbench's tables, pgfence (fenced and `--no-fence`) and PgBouncer.
//!
//! [`Stack`]'s fields are declared in the order they must stop in: proxies first, then
//! PostgreSQL, then the directory they all live in.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;

use crate::cli::Args;
use crate::error::{Error, Result};
use crate::plan::{Setup, Transport};
use crate::postgres::{self, Cluster};
use crate::proc::{self, Daemon, ServerUser, HOST};

/// The resource every fenced benchmark transaction is fenced on.
pub const RESOURCE: &str = "bench";
/// The token the session-token and sqlcommenter configurations present.
pub const TOKEN: i64 = 1000;

/// How long a proxy may take to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The programs a run uses.
#[derive(Debug, Clone)]
pub struct Programs {
    pub pgfence: PathBuf,
    pub pgbench: PathBuf,
    /// `None`: not installed, or PgBouncer was not asked for.
    pub pgbouncer: Option<PathBuf>,
    /// `None` with `--upstream`.
    pub pg_bin: Option<PathBuf>,
}

impl Programs {
    /// Finds (and for pgfence, builds) what `args` needs.
    pub fn find(args: &Args) -> Result<Programs> {
        let pg_bin = match &args.upstream {
            Some(_) => None,
            None => Some(postgres::find_bin_dir(args.pg_bin.as_deref())?),
        };
        let pgbench = find_pgbench(args.pg_bin.as_deref(), pg_bin.as_deref())?;
        let pgbouncer = if args.configs.contains(&Setup::Pgbouncer) {
            find_pgbouncer(args.pgbouncer_bin.as_deref())?
        } else {
            None
        };
        let pgfence = find_pgfence(args)?;
        Ok(Programs {
            pgfence,
            pgbench,
            pgbouncer,
            pg_bin,
        })
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn find_pgbench(given: Option<&Path>, bin: Option<&Path>) -> Result<PathBuf> {
    given
        .or(bin)
        .map(|d| d.join("pgbench"))
        .filter(|p| p.is_file())
        .or_else(|| on_path("pgbench"))
        .ok_or(Error::MissingTool {
            program: "pgbench",
            hint: "install PostgreSQL's client programs (Debian: `apt-get install -y \
                   postgresql-client`, or scripts/install-deps.sh), or pass --pg-bin DIR",
        })
}

fn find_pgbouncer(given: Option<&Path>) -> Result<Option<PathBuf>> {
    if let Some(p) = given {
        return if p.is_file() {
            Ok(Some(p.to_path_buf()))
        } else {
            Err(Error::Usage(format!(
                "--pgbouncer-bin {}: no such file",
                p.display()
            )))
        };
    }
    let found = on_path("pgbouncer").or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/pgbouncer");
        sbin.is_file().then_some(sbin)
    });
    if found.is_none() {
        eprintln!(
            "pgfence-bench: pgbouncer is not installed, so the PgBouncer comparison is \
             skipped (Debian: `apt-get install -y pgbouncer`)"
        );
    }
    Ok(found)
}

/// `--pgfence-bin`, else `target/release/pgfence` after `cargo build --release -p pgfence`
/// (unless `--no-build`).
fn find_pgfence(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.pgfence_bin {
        return if p.is_file() {
            Ok(p.clone())
        } else {
            Err(Error::Usage(format!(
                "--pgfence-bin {}: no such file",
                p.display()
            )))
        };
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .to_path_buf();
    // This binary is <target>/<profile>/pgfence-bench; pgfence is <target>/release/pgfence
    // whatever profile this one was built with.
    let target = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
        .unwrap_or_else(|| workspace.join("target"));
    let binary = target.join("release").join("pgfence");
    if !args.no_build {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        eprintln!("pgfence-bench: cargo build --release -p pgfence");
        let mut cmd = std::process::Command::new(&cargo);
        cmd.current_dir(&workspace)
            .args(["build", "--release", "-p", "pgfence"])
            .env("CARGO_TARGET_DIR", &target)
            .process_group(0);
        proc::run(
            &mut cmd,
            "cargo build --release -p pgfence",
            Duration::from_secs(3600),
        )?
        .ok_or(
            "cargo build --release -p pgfence",
            Some("fix the build, or pass --pgfence-bin PATH (and --no-build)"),
        )?;
    }
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(Error::MissingTool {
            program: "target/release/pgfence",
            hint: "build it with `cargo build --release -p pgfence`, or pass --pgfence-bin PATH",
        })
    }
}

/// The servers of a run. Dropping it stops them all and removes the work directory.
#[derive(Debug)]
pub struct Stack {
    /// pgfence with the default configuration (fence on, fast path on).
    pub fenced: Option<Daemon>,
    /// `pgfence --no-fence`.
    pub unfenced: Option<Daemon>,
    /// PgBouncer in session mode.
    pub pgbouncer: Option<Daemon>,
    /// The throwaway server; `None` with `--upstream`.
    cluster: Option<Cluster>,
    /// Where PostgreSQL listens.
    pub pg_host: String,
    pub pg_port: u16,
    /// Where the proxies reach PostgreSQL: `pg_host`, or the throwaway server's socket
    /// directory with `--proxy-upstream unix`.
    pub proxy_host: String,
    pub owner: Option<ServerUser>,
    pub programs: Programs,
    /// `--threads` for pgfence (`None`: its default).
    pub pgfence_threads: Option<usize>,
    /// Declared last: removed after everything above stopped.
    work: TempDir,
}

impl Stack {
    /// Creates the work directory and starts or finds PostgreSQL.
    pub fn start_postgres(args: &Args, programs: Programs) -> Result<Stack> {
        let owner = ServerUser::detect()?;
        let root = work_root(args.work_dir.as_deref());
        let work = tempfile::Builder::new()
            .prefix("pgfence-bench-")
            .tempdir_in(&root)
            .map_err(Error::io("create a directory in", &root))?;
        ServerUser::give(owner, work.path())?;
        let mut stack = Stack {
            fenced: None,
            unfenced: None,
            pgbouncer: None,
            cluster: None,
            pg_host: HOST.to_string(),
            pg_port: 0,
            proxy_host: HOST.to_string(),
            owner,
            programs,
            pgfence_threads: args.pgfence_threads,
            work,
        };
        match &args.upstream {
            Some(up) => {
                let (host, port) = split_host_port(up)?;
                stack.pg_host = host.clone();
                stack.pg_port = port;
                stack.proxy_host = host;
            }
            None => {
                let bin = stack.programs.pg_bin.clone().ok_or(Error::MissingTool {
                    program: "initdb",
                    hint: "pass --pg-bin DIR",
                })?;
                let max_connections = (args.idle_sessions + 50).max(100);
                let mut settings =
                    vec![("max_connections".to_string(), max_connections.to_string())];
                settings.extend(args.pg_settings());
                eprintln!(
                    "pgfence-bench: starting a throwaway PostgreSQL in {}",
                    stack.dir().display()
                );
                let cluster = Cluster::start(
                    &bin,
                    owner,
                    &stack.dir().join("pg"),
                    &args.user,
                    &settings,
                    &[],
                )?;
                stack.pg_port = cluster.port();
                if args.proxy_upstream == Transport::Unix {
                    stack.proxy_host = cluster.socket_dir().display().to_string();
                }
                stack.cluster = Some(cluster);
            }
        }
        Ok(stack)
    }

    /// The work directory.
    pub fn dir(&self) -> &Path {
        self.work.path()
    }

    /// Ports in use, so that a new server does not pick one of them.
    pub fn ports(&self) -> Vec<u16> {
        [&self.fenced, &self.unfenced, &self.pgbouncer]
            .into_iter()
            .flatten()
            .map(Daemon::port)
            .chain([self.pg_port])
            .collect()
    }

    /// `pgbench -i -s <scale>` against PostgreSQL directly.
    pub fn init_pgbench(&self, args: &Args) -> Result<()> {
        eprintln!(
            "pgfence-bench: pgbench -i -s {} (loading the tables)",
            args.scale
        );
        let mut cmd = proc::command(&self.programs.pgbench, None);
        cmd.args(["-i", "-q", "-s", &args.scale.to_string()])
            .args([
                "-h",
                &self.pg_host,
                "-p",
                &self.pg_port.to_string(),
                "-U",
                &args.user,
            ])
            .arg(&args.database);
        proc::run(&mut cmd, "pgbench -i", Duration::from_secs(3600))?.ok_or(
            "pgbench -i (loading the benchmark tables)",
            Some("check --upstream, --user and --database (and PGPASSWORD)"),
        )?;
        Ok(())
    }

    /// `pgfence install`: the schema the fence needs.
    pub fn install_fence(&self, args: &Args) -> Result<()> {
        let mut cmd = proc::command(&self.programs.pgfence, None);
        cmd.arg("install")
            .arg("--upstream")
            .arg(self.upstream())
            .args(["--database", &args.database, "--user", &args.user]);
        proc::run(&mut cmd, "pgfence install", Duration::from_secs(120))?.ok_or(
            "pgfence install (creating schema pgfence)",
            Some("the user needs CREATE on the database"),
        )?;
        Ok(())
    }

    /// PostgreSQL as pgfence's `--upstream` value (a socket directory with
    /// `--proxy-upstream unix`).
    pub fn upstream(&self) -> String {
        if self.proxy_host.contains(':') {
            format!("[{}]:{}", self.proxy_host, self.pg_port)
        } else {
            format!("{}:{}", self.proxy_host, self.pg_port)
        }
    }

    /// Starts a pgfence on a free port: `--no-fence` when `fence` is false; with `config`
    /// (TOML text) when given.
    pub fn start_pgfence(&self, name: &str, fence: bool, config: Option<&str>) -> Result<Daemon> {
        let port = proc::free_port(&self.ports());
        let mut cmd = proc::command(&self.programs.pgfence, None);
        cmd.arg("--listen")
            .arg(format!("{HOST}:{port}"))
            .arg("--upstream")
            .arg(self.upstream())
            // pgfence's default; set so that a RUST_LOG of the caller's does not slow it.
            .env("RUST_LOG", "info");
        for var in [
            "PGFENCE_CONFIG",
            "PGFENCE_NO_FENCE",
            "PGFENCE_LISTEN",
            "PGFENCE_UPSTREAM",
        ] {
            cmd.env_remove(var);
        }
        if !fence {
            cmd.arg("--no-fence");
        }
        if let Some(n) = self.pgfence_threads {
            cmd.arg("--threads").arg(n.to_string());
        }
        if let Some(text) = config {
            let path = self.dir().join(format!("{name}.toml"));
            fs::write(&path, text).map_err(Error::io("write", &path))?;
            cmd.arg("--config").arg(&path);
        }
        Daemon::start(cmd, name, port, READY_WITHIN)
    }

    /// Starts the proxies the configurations need.
    pub fn start_proxies(&mut self, args: &Args) -> Result<()> {
        if args.configs.iter().any(|c| c.fenced()) || args.stale_secs() > 0 {
            self.fenced = Some(self.start_pgfence("pgfence", true, None)?);
        }
        if args.configs.contains(&Setup::NoFence) {
            self.unfenced = Some(self.start_pgfence("pgfence-no-fence", false, None)?);
        }
        if let Some(bin) = self.programs.pgbouncer.clone() {
            let max_clients = args.clients.iter().copied().max().unwrap_or(1);
            self.pgbouncer = Some(self.start_pgbouncer(&bin, args, max_clients)?);
        }
        Ok(())
    }

    fn start_pgbouncer(&self, bin: &Path, args: &Args, max_clients: u32) -> Result<Daemon> {
        let dir = self.dir().join("pgbouncer");
        fs::create_dir_all(&dir).map_err(Error::io("create", &dir))?;
        ServerUser::give(self.owner, &dir)?;
        let port = proc::free_port(&self.ports());
        // auth_type trust still needs the user in the auth file; the password (PGPASSWORD,
        // when set) is what PgBouncer logs in to the server with.
        let password = std::env::var("PGPASSWORD").unwrap_or_default();
        let users = format!(
            "\"{}\" \"{}\"\n",
            args.user.replace('"', "\"\""),
            password.replace('"', "\"\"")
        );
        let users_path = dir.join("userlist.txt");
        fs::write(&users_path, users).map_err(Error::io("write", &users_path))?;
        ServerUser::give(self.owner, &users_path)?;
        let ini = format!(
            "[databases]\n\
             {db} = host={host} port={pg_port} dbname={db}\n\
             [pgbouncer]\n\
             listen_addr = {HOST}\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {users}\n\
             pool_mode = session\n\
             max_client_conn = {max_conn}\n\
             default_pool_size = {pool}\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            db = args.database,
            host = self.proxy_host,
            pg_port = self.pg_port,
            users = users_path.display(),
            max_conn = max_clients + 100,
            pool = max_clients + 10,
        );
        let ini_path = dir.join("pgbouncer.ini");
        fs::write(&ini_path, ini).map_err(Error::io("write", &ini_path))?;
        ServerUser::give(self.owner, &ini_path)?;
        let mut cmd = proc::command(bin, self.owner);
        cmd.arg(&ini_path);
        Daemon::start(cmd, "pgbouncer", port, READY_WITHIN)
    }

    /// The postmaster's pid of the throwaway server (`None` with `--upstream`).
    pub fn server_pid(&self) -> Option<u32> {
        self.cluster.as_ref()?.postmaster_pid()
    }

    /// The pid of the proxy `setup` goes through (`None` for PostgreSQL directly).
    pub fn proxy_pid(&self, setup: Setup) -> Option<u32> {
        let daemon = match setup {
            Setup::Direct => None,
            Setup::Pgbouncer => self.pgbouncer.as_ref(),
            Setup::NoFence => self.unfenced.as_ref(),
            Setup::NoToken | Setup::SessionToken | Setup::Sqlcommenter => self.fenced.as_ref(),
        };
        daemon.map(Daemon::pid)
    }

    /// `Err` when the proxy `setup` goes through has died.
    pub fn ensure_running(&mut self, setup: Setup) -> Result<()> {
        let daemon = match setup {
            Setup::Direct => None,
            Setup::Pgbouncer => self.pgbouncer.as_mut(),
            Setup::NoFence => self.unfenced.as_mut(),
            Setup::NoToken | Setup::SessionToken | Setup::Sqlcommenter => self.fenced.as_mut(),
        };
        daemon.map_or(Ok(()), Daemon::ensure_running)
    }
}

/// `--work-dir`, else `/dev/shm` when it has room, else the system temp directory.
fn work_root(given: Option<&Path>) -> PathBuf {
    if let Some(dir) = given {
        return dir.to_path_buf();
    }
    const SHM_MIN_FREE: u64 = 2 << 30;
    let shm = Path::new("/dev/shm");
    let room = nix::sys::statvfs::statvfs(shm)
        .map(|s| s.blocks_available().saturating_mul(s.fragment_size()) >= SHM_MIN_FREE)
        .unwrap_or(false);
    if room {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// `host:port`, `[v6]:port` or a bare host (port 5432).
pub fn split_host_port(s: &str) -> Result<(String, u16)> {
    let bad = || Error::Usage(format!("--upstream {s:?}: expected HOST:PORT"));
    if let Some(rest) = s.strip_prefix('[') {
        let (host, port) = rest.split_once("]:").ok_or_else(bad)?;
        return Ok((host.to_string(), port.parse().map_err(|_| bad())?));
    }
    match s.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => {
            Ok((host.to_string(), port.parse().map_err(|_| bad())?))
        }
        _ => Ok((s.to_string(), 5432)),
    }
}
