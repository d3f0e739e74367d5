//! Micro-benchmarks of fence-core's per-message hot path: directive extraction and
//! statement classification on realistic statements.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fence_core::{classify, directive, lexer};

const PGBENCH_SELECT: &str = "SELECT abalance FROM pgbench_accounts WHERE aid = $1;";
const PGBENCH_UPDATE: &str = "UPDATE pgbench_accounts SET abalance = abalance + $1 WHERE aid = $2;";
const SQLCOMMENTER: &str = "UPDATE jobs SET state = 'running', started_at = now() WHERE id = $1 \
     /*action='run',controller='scheduler',fencing_resource='billing',fencing_token='34',\
     framework='django%3A4.2'*/";

/// A 2 KB ORM-style SELECT with a leading fencing comment.
fn orm_select() -> String {
    let mut sql = String::from(
        "/* fencing_token=34 fencing_resource=billing */ SELECT \"invoices\".\"id\", \
         \"invoices\".\"customer_id\", \"invoices\".\"amount_cents\", \"invoices\".\"currency\", \
         \"invoices\".\"status\", \"invoices\".\"created_at\", \"invoices\".\"updated_at\"",
    );
    let mut i = 0;
    while sql.len() < 1900 {
        sql.push_str(&format!(
            ", \"customers_{i}\".\"name\" AS \"customer_name_{i}\", \
             COALESCE(\"customers_{i}\".\"email\", '') AS \"customer_email_{i}\""
        ));
        i += 1;
    }
    sql.push_str(
        " FROM \"invoices\" INNER JOIN \"customers\" ON \"customers\".\"id\" = \
         \"invoices\".\"customer_id\" WHERE \"invoices\".\"status\" IN ($1, $2, $3) AND \
         \"invoices\".\"created_at\" >= $4 ORDER BY \"invoices\".\"created_at\" DESC LIMIT 50",
    );
    sql
}

fn bench(c: &mut Criterion) {
    let orm = orm_select();
    let cases: [(&str, &[u8]); 4] = [
        ("pgbench_select", PGBENCH_SELECT.as_bytes()),
        ("pgbench_update", PGBENCH_UPDATE.as_bytes()),
        ("sqlcommenter", SQLCOMMENTER.as_bytes()),
        ("orm_select_2k", orm.as_bytes()),
    ];
    let mut lex = c.benchmark_group("lexer");
    for (name, sql) in cases {
        lex.throughput(Throughput::Bytes(sql.len() as u64));
        lex.bench_function(name, |b| {
            b.iter(|| lexer::Lexer::new(black_box(sql)).count())
        });
    }
    lex.finish();

    let mut extract = c.benchmark_group("directive_extract");
    for (name, sql) in cases {
        extract.throughput(Throughput::Bytes(sql.len() as u64));
        extract.bench_function(name, |b| b.iter(|| directive::extract(black_box(sql))));
    }
    extract.finish();

    let mut analyze = c.benchmark_group("classify_analyze");
    for (name, sql) in cases {
        analyze.throughput(Throughput::Bytes(sql.len() as u64));
        analyze.bench_function(name, |b| b.iter(|| classify::analyze(black_box(sql))));
    }
    analyze.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
