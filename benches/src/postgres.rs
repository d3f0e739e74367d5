//! The throwaway PostgreSQL server: `initdb` into the run's directory, settings for a
//! benchmark, `pg_ctl start` on a free port, `pg_ctl stop -m immediate` on drop.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::proc::{self, ServerUser, HOST};

/// Settings every throwaway server gets, before the user's `--pg-setting`s (which win).
/// `fsync` and `full_page_writes` keep their defaults: this is the server a user would
/// compare against. `synchronous_commit = off` takes the WAL flush wait out of COMMIT,
/// which would otherwise dominate a TPC-B transaction on a slow disk and hide the proxy's
/// cost (docs/benchmarks.md).
const SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "'127.0.0.1'"),
    ("shared_buffers", "'256MB'"),
    ("synchronous_commit", "off"),
    ("log_min_messages", "warning"),
    ("log_connections", "off"),
    ("log_disconnections", "off"),
];

/// How often a start is retried after losing the race for its port.
const START_ATTEMPTS: usize = 5;

/// Where the PostgreSQL programs are: `--pg-bin`, else `pg_config --bindir` when it holds
/// `initdb`, else the newest `/usr/lib/postgresql/<version>/bin`.
pub fn find_bin_dir(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(dir) = given {
        return if dir.join("initdb").is_file() {
            Ok(dir.to_path_buf())
        } else {
            Err(Error::Usage(format!(
                "--pg-bin {}: no initdb there; pass the directory of PostgreSQL's server \
                 programs, e.g. /usr/lib/postgresql/15/bin",
                dir.display()
            )))
        };
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && dir.join("initdb").is_file() {
            return Ok(dir);
        }
    }
    fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max()
        .map(|(_, bin)| bin)
        .ok_or(Error::MissingTool {
            program: "PostgreSQL (initdb)",
            hint: "install the PostgreSQL server (Debian: `apt-get install -y postgresql`, or \
                   scripts/install-deps.sh), pass --pg-bin DIR, or benchmark an existing \
                   server with --upstream HOST:PORT",
        })
}

/// A running throwaway server. Stopped on drop; its directory belongs to the caller.
#[derive(Debug)]
pub struct Cluster {
    bin: PathBuf,
    owner: Option<ServerUser>,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    socket_dir: PathBuf,
    running: bool,
}

impl Cluster {
    /// `initdb` in `dir/data` with superuser `user` (trusted on 127.0.0.1), the benchmark
    /// settings plus `extra`, started on a free port other than `taken`.
    pub fn start(
        bin: &Path,
        owner: Option<ServerUser>,
        dir: &Path,
        user: &str,
        extra: &[(String, String)],
        taken: &[u16],
    ) -> Result<Cluster> {
        let socket_dir = dir.join("sock");
        fs::create_dir_all(&socket_dir).map_err(Error::io("create", &socket_dir))?;
        ServerUser::give(owner, dir)?;
        ServerUser::give(owner, &socket_dir)?;
        let mut cluster = Cluster {
            bin: bin.to_path_buf(),
            owner,
            data: dir.join("data"),
            log: dir.join("postgresql.log"),
            port: 0,
            socket_dir: socket_dir.clone(),
            running: false,
        };
        let mut initdb = proc::command(&bin.join("initdb"), owner);
        initdb.arg("-D").arg(&cluster.data).args([
            "-U",
            user,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]);
        proc::run(&mut initdb, "initdb", Duration::from_secs(300))?.ok_or(
            "initdb",
            Some("is the work directory writable by the postgres OS user? (--work-dir)"),
        )?;
        let mut conf = String::from("\n# Added by pgfence-bench.\n");
        let socket = format!("'{}'", socket_dir.display());
        let own = SETTINGS
            .iter()
            .map(|&(k, v)| (k.to_string(), v.to_string()))
            .chain([("unix_socket_directories".to_string(), socket)])
            .chain(extra.iter().cloned());
        for (name, value) in own {
            conf.push_str(&format!("{name} = {value}\n"));
        }
        let path = cluster.data.join("postgresql.conf");
        fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(Error::io("append to", &path))?;

        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            cluster.port = proc::free_port(taken);
            match cluster.pg_ctl_start() {
                Ok(()) => {
                    cluster.running = true;
                    return Ok(cluster);
                }
                Err(e) if cluster.lost_port_race() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(Error::Interrupted))
    }

    /// The directory of its Unix-domain socket.
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn server_log(&self) -> String {
        fs::read(&self.log)
            .map(|b| proc::tail(&String::from_utf8_lossy(&b), 30))
            .unwrap_or_default()
    }

    fn lost_port_race(&self) -> bool {
        let log = self.server_log();
        log.contains("Address already in use") || log.contains("could not bind")
    }

    fn pg_ctl_start(&self) -> Result<()> {
        let _ = fs::remove_file(&self.log);
        let mut cmd = proc::command(&self.bin.join("pg_ctl"), self.owner);
        cmd.arg("start")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(&self.log)
            .args(["-w", "-t", "120", "-o"])
            .arg(format!("-p {} -h {HOST}", self.port));
        let out = proc::run(&mut cmd, "pg_ctl start", Duration::from_secs(150))?;
        if out.status.success() {
            return Ok(());
        }
        let _ = self.pg_ctl_stop();
        Err(Error::Failed {
            what: "starting PostgreSQL (pg_ctl start)".to_string(),
            status: out.status.to_string(),
            output: format!(
                "{}{}\n--- server log ---\n{}",
                out.stdout,
                out.stderr,
                self.server_log()
            ),
            hint: Some("check the settings given with --pg-setting"),
        })
    }

    /// `pg_ctl stop -m fast`, else `-m immediate`. A fast shutdown removes the server's
    /// shared memory segments in /dev/shm; an immediate one leaves them behind.
    fn pg_ctl_stop(&self) -> Result<()> {
        self.pg_ctl_stop_mode("fast", "20")
            .or_else(|_| self.pg_ctl_stop_mode("immediate", "60"))
    }

    fn pg_ctl_stop_mode(&self, mode: &str, wait_secs: &str) -> Result<()> {
        let mut cmd = proc::command(&self.bin.join("pg_ctl"), self.owner);
        cmd.arg("stop")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", mode, "-w", "-t", wait_secs]);
        // Not `proc::run`: this runs during cleanup, after a signal too.
        match cmd.output() {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(Error::Failed {
                what: format!("pg_ctl stop -m {mode}"),
                status: out.status.to_string(),
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
                hint: None,
            }),
            Err(source) => Err(Error::Spawn {
                program: "pg_ctl".to_string(),
                source,
            }),
        }
    }

    /// The postmaster's pid, from `postmaster.pid` (`None` once it stopped).
    pub fn postmaster_pid(&self) -> Option<u32> {
        let path = self.data.join("postmaster.pid");
        fs::read_to_string(path)
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.running {
            if let Err(e) = self.pg_ctl_stop() {
                eprintln!("pgfence-bench: stopping PostgreSQL failed: {e}");
            }
        }
    }
}
