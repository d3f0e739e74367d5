//! CPU time per transaction, from `/proc`: the whole machine's (what bounds throughput when
//! client, proxy and server share the cores) and the proxy's own. Unlike TPS, these barely
//! move when the machine is busy with something else, so they compare configurations even
//! where the rounds' TPS disagree.

use std::fs;

/// CPU counters at one moment, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Busy time of every CPU (user, nice, system, irq, softirq, steal).
    machine: Option<u64>,
    /// The proxy process's user and system time.
    proxy: Option<u64>,
}

/// Reads the counters; `proxy` is the pid of the proxy the run goes through, if any.
pub fn sample(proxy: Option<u32>) -> Sample {
    Sample {
        machine: fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| machine_busy(&s)),
        proxy: proxy.and_then(|pid| {
            fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| process_time(&s))
        }),
    }
}

/// Microseconds of CPU per transaction between two samples: (machine, proxy).
pub fn per_transaction(
    before: Sample,
    after: Sample,
    transactions: u64,
) -> (Option<f64>, Option<f64>) {
    let us_per_tick = 1e6 / ticks_per_second();
    let per = |a: Option<u64>, b: Option<u64>| {
        let (a, b) = (a?, b?);
        (transactions > 0 && b >= a).then(|| (b - a) as f64 * us_per_tick / transactions as f64)
    };
    (
        per(before.machine, after.machine),
        per(before.proxy, after.proxy),
    )
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

/// utime + stime from `/proc/<pid>/stat` (fields 14 and 15; the command name in field 2
/// may contain spaces and parentheses, so count from the last `)`).
fn process_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_reads_proc_formats() {
        let stat = "cpu  100 5 50 1000 7 3 2 1 0 0\ncpu0 50 2 25 500 3 1 1 0 0 0\n";
        assert_eq!(machine_busy(stat), Some(100 + 5 + 50 + 3 + 2 + 1));
        assert_eq!(machine_busy("intr 1 2\n"), None);
        let pid = "1234 (pg fence) (x)) S 1 1234 1234 0 -1 4194560 500 0 0 0 42 17 0 0 20 0 1 0";
        assert_eq!(process_time(pid), Some(59));
        assert_eq!(process_time("1234 (short) S 1"), None);
    }

    #[test]
    fn cpu_per_transaction_divides_and_refuses_nonsense() {
        let a = Sample {
            machine: Some(1_000),
            proxy: Some(10),
        };
        let b = Sample {
            machine: Some(1_200),
            proxy: Some(30),
        };
        let (m, p) = per_transaction(a, b, 1_000);
        let tick = 1e6 / ticks_per_second();
        assert_eq!(m, Some(200.0 * tick / 1_000.0));
        assert_eq!(p, Some(20.0 * tick / 1_000.0));
        assert_eq!(per_transaction(a, b, 0), (None, None));
        assert_eq!(per_transaction(b, a, 10), (None, None));
        let none = Sample {
            machine: None,
            proxy: None,
        };
        assert_eq!(per_transaction(none, b, 10), (None, None));
    }

    #[test]
    fn cpu_samples_this_machine() {
        let s = sample(Some(std::process::id()));
        assert!(s.machine.is_some());
        assert!(s.proxy.is_some());
    }
}
