//! CPU time per transaction, from `/proc`: the whole machine's (what bounds throughput when
//! client, proxy and server share the cores), the proxy's own, and the PostgreSQL server's
//! (what a check pgfence adds to a transaction costs it). Unlike TPS, these barely move
//! when the machine is busy with something else, so they compare configurations even where
//! the rounds' TPS disagree.

use std::fs;

/// CPU counters at one moment, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Busy time of every CPU (user, nice, system, irq, softirq, steal).
    machine: Option<u64>,
    /// The proxy process's user and system time.
    proxy: Option<u64>,
    /// The server's: the postmaster's own and its reaped children's, plus that of every
    /// child still there (backends, background processes).
    server: Option<u64>,
}

/// CPU µs per transaction between two samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerTransaction {
    pub machine: Option<f64>,
    pub proxy: Option<f64>,
    pub server: Option<f64>,
}

/// Reads the counters; `proxy` is the pid of the proxy the run goes through, if any, and
/// `server` the postmaster's, if the server runs on this machine.
pub fn sample(proxy: Option<u32>, server: Option<u32>) -> Sample {
    Sample {
        machine: fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| machine_busy(&s)),
        proxy: proxy.and_then(|pid| {
            fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| process_times(&s))
                .map(|t| t.own)
        }),
        server: server.and_then(server_time),
    }
}

/// Microseconds of CPU per transaction between two samples.
pub fn per_transaction(before: Sample, after: Sample, transactions: u64) -> PerTransaction {
    let us_per_tick = 1e6 / ticks_per_second();
    let per = |a: Option<u64>, b: Option<u64>| {
        let (a, b) = (a?, b?);
        (transactions > 0 && b >= a).then(|| (b - a) as f64 * us_per_tick / transactions as f64)
    };
    PerTransaction {
        machine: per(before.machine, after.machine),
        proxy: per(before.proxy, after.proxy),
        server: per(before.server, after.server),
    }
}

/// The CPU time of postmaster `pid` and all its processes. A backend that exits is counted
/// by its own entry until the postmaster reaps it and by the postmaster's children's time
/// after: the postmaster is read before and after its children, and again if a child was
/// reaped in between, so that none is counted twice or missed.
fn server_time(pid: u32) -> Option<u64> {
    let postmaster = || {
        fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| process_times(&s))
    };
    for _ in 0..5 {
        let before = postmaster()?;
        let children: u64 = fs::read_dir("/proc")
            .ok()?
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            })
            .filter_map(|e| fs::read_to_string(e.path().join("stat")).ok())
            .filter_map(|s| process_times(&s))
            .filter(|t| t.parent == pid)
            .map(|t| t.own + t.children)
            .sum();
        let after = postmaster()?;
        if after.children == before.children {
            return Some(after.own + after.children + children);
        }
    }
    None
}

fn ticks_per_second() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&t| t > 0)
        .map_or(100.0, |t| t as f64)
}

/// Busy ticks from the aggregate `cpu` line of `/proc/stat`.
fn machine_busy(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    // already counted in user.
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    (v.len() >= 4).then(|| at(0) + at(1) + at(2) + at(5) + at(6) + at(7))
}

/// What `/proc/<pid>/stat` says of a process's CPU time, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Times {
    parent: u32,
    /// utime + stime.
    own: u64,
    /// cutime + cstime: its children that it waited for.
    children: u64,
}

/// Fields 4 (ppid) and 14 to 17 (utime, stime, cutime, cstime) of `/proc/<pid>/stat`; the
/// command name in field 2 may contain spaces and parentheses, so count from the last `)`.
fn process_times(stat: &str) -> Option<Times> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i)?.parse::<u64>().ok();
    Some(Times {
        parent: f.get(1)?.parse().ok()?,
        own: field(11)? + field(12)?,
        children: field(13)? + field(14)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_reads_proc_formats() {
        let stat = "cpu  100 5 50 1000 7 3 2 1 0 0\ncpu0 50 2 25 500 3 1 1 0 0 0\n";
        assert_eq!(machine_busy(stat), Some(100 + 5 + 50 + 3 + 2 + 1));
        assert_eq!(machine_busy("intr 1 2\n"), None);
        let pid = "1234 (pg fence) (x)) S 7 1234 1234 0 -1 4194560 500 0 0 0 42 17 5 3 20 0 1 0";
        let times = Times {
            parent: 7,
            own: 59,
            children: 8,
        };
        assert_eq!(process_times(pid), Some(times));
        assert_eq!(process_times("1234 (short) S 1"), None);
    }

    #[test]
    fn cpu_per_transaction_divides_and_refuses_nonsense() {
        let a = Sample {
            machine: Some(1_000),
            proxy: Some(10),
            server: Some(500),
        };
        let b = Sample {
            machine: Some(1_200),
            proxy: Some(30),
            server: Some(600),
        };
        let tick = 1e6 / ticks_per_second();
        assert_eq!(
            per_transaction(a, b, 1_000),
            PerTransaction {
                machine: Some(200.0 * tick / 1_000.0),
                proxy: Some(20.0 * tick / 1_000.0),
                server: Some(100.0 * tick / 1_000.0),
            }
        );
        let nothing = PerTransaction {
            machine: None,
            proxy: None,
            server: None,
        };
        assert_eq!(per_transaction(a, b, 0), nothing);
        assert_eq!(per_transaction(b, a, 10), nothing);
        let none = Sample {
            machine: None,
            proxy: None,
            server: None,
        };
        assert_eq!(per_transaction(none, b, 10), nothing);
    }

    #[test]
    fn cpu_samples_this_machine() {
        let s = sample(Some(std::process::id()), Some(std::process::id()));
        assert!(s.machine.is_some());
        assert!(s.proxy.is_some());
        assert!(s.server.is_some());
        assert_eq!(sample(None, Some(u32::MAX)).server, None);
    }

    /// A server's time includes its children's, before and after they are reaped: this
    /// test process stands in for the postmaster, a busy shell for a backend.
    #[test]
    fn server_time_counts_children_before_and_after_reaping() {
        let me = std::process::id();
        let before = server_time(me).expect("this process");
        let mut child = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done"])
            .spawn()
            .expect("sh");
        // Wait until it has exited but is not reaped (a zombie keeps its times).
        let stat = format!("/proc/{}/stat", child.id());
        let state = || {
            let s = fs::read_to_string(&stat).unwrap_or_default();
            s.rfind(')')
                .and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_owned))
        };
        while state().as_deref() != Some("Z") {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let exited = server_time(me).expect("this process");
        child.wait().expect("wait");
        let reaped = server_time(me).expect("this process");
        // The loop takes a few hundred ms of CPU however busy the machine is.
        let ms = |ticks: u64| ticks as f64 * 1e3 / ticks_per_second();
        assert!(ms(exited - before) >= 100.0, "{before} -> {exited} ticks");
        assert!(ms(reaped - before) >= 100.0, "{before} -> {reaped} ticks");
    }
}
