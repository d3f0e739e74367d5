//! What the machine provides for clusters: the PostgreSQL binaries, the OS user servers run
//! as, where cluster directories go, and the cleanup of what dead test processes left there.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use nix::unistd::{Gid, Uid, User};

use crate::process;

/// Prefix of cluster directories; the test process id follows it.
pub(crate) const DIR_PREFIX: &str = "pgfence-pg-";
/// How long `pg_ctl` may wait for the server to start or stop.
pub(crate) const PG_CTL_WAIT_SECS: &str = "60";
/// The directory with `initdb`, `pg_ctl`, `postgres`, `psql` and `pgbench`: env
/// `PGFENCE_PG_BIN` when set, else `pg_config --bindir` when it holds `initdb`, else the
/// newest `/usr/lib/postgresql/<version>/bin`.
pub fn pg_bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(find_bin_dir)
}

fn find_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PGFENCE_PG_BIN") {
        return PathBuf::from(dir);
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && dir.join("initdb").is_file() {
            return dir;
        }
    }
    let newest = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max();
    match newest {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL server binaries not found: no initdb in `pg_config --bindir` nor in \
             /usr/lib/postgresql/*/bin; run scripts/install-deps.sh or set PGFENCE_PG_BIN"
        ),
    }
}

/// tmpfs, preferred for cluster directories.
const SHM: &str = "/dev/shm";
/// Free space `/dev/shm` needs to be used (docker gives containers 64 MiB).
const SHM_MIN_FREE: u64 = 2 << 30;

/// Where cluster directories are made: env `PGFENCE_TEST_TMPDIR`, else `/dev/shm` when it
/// has room, else `/tmp`.
pub(crate) fn cluster_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        if let Some(dir) = std::env::var_os("PGFENCE_TEST_TMPDIR") {
            return PathBuf::from(dir);
        }
        let shm_has_room = nix::sys::statvfs::statvfs(SHM)
            .map(|s| s.blocks_available().saturating_mul(s.fragment_size()) >= SHM_MIN_FREE)
            .unwrap_or(false);
        PathBuf::from(if shm_has_room { SHM } else { "/tmp" })
    })
}

/// The OS user the server runs as, when it is not the current user.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServerUser {
    pub uid: Uid,
    pub gid: Gid,
}

/// `Some(postgres)` when running as root, `None` (run as ourselves) otherwise.
pub(crate) fn server_user() -> Option<ServerUser> {
    static USER: OnceLock<Option<ServerUser>> = OnceLock::new();
    *USER.get_or_init(|| {
        if !Uid::effective().is_root() {
            return None;
        }
        let user = User::from_name("postgres")
            .expect("look up the `postgres` OS user")
            .expect(
                "running as root, the harness runs PostgreSQL as the `postgres` OS user, which \
                 does not exist: install the postgresql package (scripts/install-deps.sh)",
            );
        Some(ServerUser {
            uid: user.uid,
            gid: user.gid,
        })
    })
}

/// A command for `program` run as the server's OS user (when running as root) in `cwd`,
/// without libpq variables that would override the harness's choices.
pub(crate) fn server_command(program: &Path, owner: Option<ServerUser>, cwd: &Path) -> Command {
    let mut cmd = Command::new(program);
    // The postgres user cannot enter root's home or the test's working directory.
    cmd.current_dir(cwd).env("HOME", cwd);
    for var in [
        "PGDATA",
        "PGPORT",
        "PGHOST",
        "PGOPTIONS",
        "PGUSER",
        "PGDATABASE",
    ] {
        cmd.env_remove(var);
    }
    if let Some(o) = owner {
        cmd.uid(o.uid.as_raw()).gid(o.gid.as_raw());
    }
    cmd
}

pub(crate) fn pg_ctl_stop(
    bin_dir: &Path,
    owner: Option<ServerUser>,
    cwd: &Path,
    data: &Path,
    mode: &str,
) -> Result<(), String> {
    let mut cmd = server_command(&bin_dir.join("pg_ctl"), owner, cwd);
    cmd.arg("stop")
        .arg("-D")
        .arg(data)
        .args(["-m", mode, "-w", "-t", PG_CTL_WAIT_SECS]);
    let out = process::run(&mut cmd, None, Duration::from_secs(90));
    if out.success() {
        Ok(())
    } else {
        Err(format!(
            "pg_ctl stop: {}\n{}{}",
            out.describe(),
            out.stdout,
            out.stderr
        ))
    }
}

/// Stops and removes the clusters of test processes that died without cleaning up. Once per
/// process, before its first cluster.
pub(crate) fn sweep_orphans() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut roots = vec![cluster_root(), Path::new(SHM), Path::new("/tmp")];
        roots.dedup();
        for dir in orphaned_dirs(&roots, DIR_PREFIX) {
            let data = dir.join("data");
            if data.join("postmaster.pid").exists() {
                let started = Instant::now();
                let _ = pg_ctl_stop(pg_bin_dir(), server_user(), &dir, &data, "immediate");
                eprintln!(
                    "harness: stopped an orphaned cluster in {} ({:?})",
                    dir.display(),
                    started.elapsed()
                );
            }
            let _ = fs::remove_dir_all(&dir);
        }
    });
}

/// The directories in `roots` named `<prefix><pid>-...` whose test process `pid` is gone.
pub(crate) fn orphaned_dirs(roots: &[&Path], prefix: &str) -> Vec<PathBuf> {
    roots
        .iter()
        .filter_map(|r| fs::read_dir(r).ok())
        .flatten()
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let owner = name
                .to_str()
                .and_then(|n| n.strip_prefix(prefix))
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok());
            owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .map(|entry| entry.path())
        .collect()
}
