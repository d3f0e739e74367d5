//! The pgbench overhead runner (see README, "Benchmarking").
fn main() {}
