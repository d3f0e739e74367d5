//! What is measured: the configurations (how pgbench reaches PostgreSQL) and the cells
//! (workload, query mode, clients) each of them runs.

use clap::ValueEnum;
use serde::Serialize;

/// How pgbench reaches PostgreSQL. The order here is the order of the table, the chart and
/// the interleaving within a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setup {
    /// PostgreSQL itself: the baseline.
    Direct,
    /// PgBouncer in session mode (skipped when pgbouncer is not installed).
    Pgbouncer,
    /// `pgfence --no-fence`: the proxy alone, nothing injected.
    NoFence,
    /// pgfence with the fence on; the client presents no token.
    NoToken,
    /// pgfence; the token comes from the startup packet (`options=-c fencing.token=N`).
    SessionToken,
    /// pgfence; every statement carries a sqlcommenter comment with the token.
    Sqlcommenter,
}

impl Setup {
    /// Every configuration, in table order.
    pub const ALL: [Setup; 6] = [
        Setup::Direct,
        Setup::Pgbouncer,
        Setup::NoFence,
        Setup::NoToken,
        Setup::SessionToken,
        Setup::Sqlcommenter,
    ];

    /// The name in tables, the chart and JSON.
    pub fn label(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::Pgbouncer => "pgbouncer",
            Setup::NoFence => "pgfence --no-fence",
            Setup::NoToken => "pgfence, no token",
            Setup::SessionToken => "pgfence, session token",
            Setup::Sqlcommenter => "pgfence, sqlcommenter",
        }
    }

    /// The value of `--configs` that selects it.
    pub fn key(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::Pgbouncer => "pgbouncer",
            Setup::NoFence => "no-fence",
            Setup::NoToken => "no-token",
            Setup::SessionToken => "session-token",
            Setup::Sqlcommenter => "sqlcommenter",
        }
    }

    /// Chart colour.
    pub fn colour(self) -> &'static str {
        match self {
            Setup::Direct => "#4d4d4d",
            Setup::Pgbouncer => "#e69f00",
            Setup::NoFence => "#9ecae1",
            Setup::NoToken => "#3182bd",
            Setup::SessionToken => "#009e73",
            Setup::Sqlcommenter => "#cc79a7",
        }
    }

    /// Whether it goes through the fenced pgfence (and so needs the schema).
    pub fn fenced(self) -> bool {
        matches!(
            self,
            Setup::NoToken | Setup::SessionToken | Setup::Sqlcommenter
        )
    }

    /// Whether it carries a token, and so has a ratio to [`Setup::NoToken`].
    pub fn has_token(self) -> bool {
        matches!(self, Setup::SessionToken | Setup::Sqlcommenter)
    }
}

/// The pgbench transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// pgbench's built-in `select-only`: one primary-key SELECT, no transaction block.
    SelectOnly,
    /// pgbench's built-in `tpcb-like`: BEGIN, three UPDATEs, a SELECT, an INSERT, END.
    TpcbLike,
}

impl Workload {
    /// The name in tables and file names.
    pub fn key(self) -> &'static str {
        match self {
            Workload::SelectOnly => "select-only",
            Workload::TpcbLike => "tpcb-like",
        }
    }
}

/// pgbench's `-M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One Query message per statement.
    Simple,
    /// Parse once per connection, then Bind/Execute/Sync per statement.
    Prepared,
}

impl Mode {
    /// The value of pgbench's `-M`.
    pub fn key(self) -> &'static str {
        match self {
            Mode::Simple => "simple",
            Mode::Prepared => "prepared",
        }
    }
}

/// How the proxies reach PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// TCP to the server's address.
    Tcp,
    /// The throwaway server's Unix-domain socket, as a proxy on the database's host would.
    Unix,
}

impl Transport {
    /// The value of `--proxy-upstream`.
    pub fn key(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Unix => "unix",
        }
    }
}

/// One workload at one mode and client count: a group of bars in the chart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Cell {
    pub workload: Workload,
    pub mode: Mode,
    pub clients: u32,
}

impl Cell {
    /// `select-only, prepared, 8 clients`.
    pub fn label(&self) -> String {
        format!(
            "{}, {}, {} client{}",
            self.workload.key(),
            self.mode.key(),
            self.clients,
            if self.clients == 1 { "" } else { "s" }
        )
    }

    /// A name usable in file names.
    pub fn slug(&self) -> String {
        format!(
            "{}-{}-c{}",
            self.workload.key(),
            self.mode.key(),
            self.clients
        )
    }
}

/// Every combination, workload outermost (the order of the table and chart).
pub fn cells(workloads: &[Workload], modes: &[Mode], clients: &[u32]) -> Vec<Cell> {
    let mut out = Vec::new();
    for &workload in workloads {
        for &mode in modes {
            for &clients in clients {
                out.push(Cell {
                    workload,
                    mode,
                    clients,
                });
            }
        }
    }
    out
}
