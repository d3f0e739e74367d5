//! Running the Node.js driver scripts in `tests/node/` (see its README for their
//! convention).
//!
//! Node.js and the drivers (`tests/node/node_modules`, from the committed lockfile) are
//! installed by `scripts/install-deps.sh`. Outside CI a test skips (loudly) when either is
//! missing; with env `CI` set, [`node_or_skip`] fails the test instead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::python::in_ci;
use crate::{drivers, process};

/// Deadline of one script run (each test inside has its own, shorter one).
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

/// The packages of `tests/node/package.json`, which every script may load.
const PACKAGES: &[&str] = &["pg", "pg-copy-streams", "pg-cursor", "postgres"];

/// `tests/node/`.
pub fn node_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("node")
}

/// A `node` that can load every driver from `tests/node/node_modules`: env `PGFENCE_NODE`,
/// else `node` on `PATH`, else `/usr/bin/node`. `Err` says what is missing.
pub fn node() -> Result<PathBuf, String> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FOUND.get_or_init(find_node).clone()
}

fn find_node() -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("PGFENCE_NODE") {
        candidates.push(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("node")));
    }
    candidates.push(PathBuf::from("/usr/bin/node"));
    let node = candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| "no `node` found".to_string())?;
    if !node_dir().join("node_modules").is_dir() {
        return Err(format!(
            "{} is missing",
            node_dir().join("node_modules").display()
        ));
    }
    let load = PACKAGES
        .iter()
        .map(|p| format!("require('{p}');"))
        .collect::<String>();
    let mut cmd = Command::new(&node);
    cmd.args(["-e", &load]).current_dir(node_dir());
    let out = process::run(&mut cmd, None, Duration::from_secs(60));
    if !out.success() {
        return Err(format!(
            "{} cannot load {PACKAGES:?} from {} ({}): {}",
            node.display(),
            node_dir().display(),
            out.describe(),
            out.stderr.trim()
        ));
    }
    Ok(node)
}

/// [`node`], or, when it is missing: outside CI `None` after a loud SKIP line for `test`; in
/// CI a panic (CI installs Node.js and the drivers, so their absence is a bug).
pub fn node_or_skip(test: &str) -> Option<PathBuf> {
    match node() {
        Ok(node) => Some(node),
        Err(missing) if in_ci() => {
            panic!("{test}: {missing}, and CI must have it (scripts/install-deps.sh)")
        }
        Err(missing) => {
            eprintln!(
                "SKIP {test}: {missing}; run scripts/install-deps.sh \
                 (or `apt-get install nodejs npm` and `npm ci` in tests/node)"
            );
            None
        }
    }
}

/// Runs `script` (a file name in `tests/node/`) with `env` added, killing it after 2
/// minutes. Returns its stdout, or its failure (the command, how it ended, stdout and
/// stderr). Panics only when there is no usable node (check [`node_or_skip`] first).
pub fn try_run_node(script: &str, env: &[(&str, &str)]) -> Result<String, String> {
    let node = node().unwrap_or_else(|missing| {
        panic!("try_run_node({script}): {missing}; call node_or_skip first")
    });
    let path = node_dir().join(script);
    let mut cmd = Command::new(&node);
    cmd.arg(&path).current_dir(node_dir());
    drivers::run_script(cmd, &node, &path, env, SCRIPT_TIMEOUT)
}
