// postgres.js through pgfence (PGFENCE_DSN), and directly against PostgreSQL when PGFENCE_DSN
// is not set, so the expectations themselves are checked there.
//
// postgres.js uses the extended protocol its own way: every query is a named prepared
// statement (Parse/Describe/Sync, then Bind/Execute/Sync), queued queries are pipelined on
// one connection without waiting for the replies, `sql.begin` pipelines the statements of a
// block, a failed prepared statement is retried once, COPY goes through `.readable()` and
// `.writable()`, cursors through `.cursor(n)`, cancel through `query.cancel()`.
// PGFENCE_FENCE (see pgfence_test.js) says whether stale writes must be rejected (exact
// FN001, nothing landed) or must land. Every wait is bounded: a hang is a FAIL.
'use strict';

const assert = require('node:assert/strict');
const { pipeline } = require('node:stream/promises');
const { Readable, Writable } = require('node:stream');
const postgres = require('postgres');
const {
  FENCED,
  TARGET,
  TOKEN_A,
  TOKEN_B,
  WAIT_MS,
  assertCode,
  assertFence,
  direct,
  directCount,
  expectStale,
  outcome,
  run,
  uniqueName,
  within,
} = require('./pgfence_test');

const table = (name) => uniqueName('pjs', name);
const resource = (name) => uniqueName('pjs', name).replace(/_/g, '.');

// A postgres.js instance of one connection to the tested target, with startup parameters
// `connection` and other `extra` options.
function connect(connection = {}, extra = {}) {
  return postgres({
    ...TARGET,
    max: 1,
    onnotice: () => {},
    connect_timeout: 5,
    connection,
    ...extra,
  });
}

// Startup parameters that present `token` for `resource` through `options`.
const tokenOptions = (token, res) => ({ options: `-c fencing.token=${token} -c fencing.resource=${res}` });

async function close(sql) {
  await within(sql.end({ timeout: 1 }), WAIT_MS, 'sql.end');
}

// Runs `fn(sql)` with a fresh one-connection instance, ending it after.
async function withSql(connection, fn, extra) {
  const sql = connect(connection, extra);
  try {
    return await fn(sql);
  } finally {
    await close(sql);
  }
}

async function createTable(name, columns = 'id int PRIMARY KEY, who text') {
  const t = table(name);
  await direct(`CREATE TABLE ${t} (${columns})`);
  return t;
}

// A newer leader writes one row with `token` through the tested target, so the fence of
// `res` is `token` when it is enforced.
async function takeFence(t, res, token = TOKEN_B) {
  await withSql(tokenOptions(token, res), (sql) => within(sql`INSERT INTO ${sql(t)} (id, who) VALUES (${-token}, 'B')`, WAIT_MS, 'take the fence'));
  await assertFence(res, token);
}

// The connection is usable (and not in a transaction block).
async function assertUsable(sql, context) {
  const rows = await within(sql`SELECT 1 AS one`, WAIT_MS, context);
  assert.deepEqual([...rows], [{ one: 1 }], `${context}: session not usable`);
  // ROLLBACK outside a block only warns; inside a failed or open block it would end it.
  const r = await within(sql`ROLLBACK`, WAIT_MS, `${context}: ROLLBACK`);
  assert.equal(r.command, 'ROLLBACK');
  assert.equal(await within(sql`SELECT 2 AS two`.then((x) => x[0].two), WAIT_MS, context), 2);
}

const tests = {
  async parameters() {
    await withSql({}, async (sql) => {
      const [row] = await sql`
        SELECT ${42}::int AS i, ${"it's"}::text AS t, ${null}::text AS n,
               ${sql.json({ a: [1, 2] })}::jsonb AS j, ${Buffer.from([0, 255])}::bytea AS b,
               ${'9223372036854775807'}::bigint AS big, ARRAY[1, 2, 3]::int[] AS arr`;
      assert.deepEqual({ ...row }, {
        i: 42,
        t: "it's",
        n: null,
        j: { a: [1, 2] },
        b: Buffer.from([0, 255]),
        big: '9223372036854775807',
        arr: [1, 2, 3],
      });
      // The same statement again: postgres.js binds its prepared statement.
      for (const v of [1, 2, 3]) assert.equal((await sql`SELECT ${v}::int * 10 AS x`)[0].x, v * 10);
      // Unprepared, and a simple Query with several statements.
      assert.equal((await sql.unsafe('SELECT $1::int AS x', [7], { prepare: false }))[0].x, 7);
      const multi = await sql.unsafe('SELECT 1 AS a; SELECT 2 AS b').simple();
      assert.deepEqual(multi.map((r) => [...r]), [[{ a: 1 }], [{ b: 2 }]]);
      assertCode(await outcome(sql`SELECT 1/${0}::int`, 'div0'), '22012', 'division by zero');
      await assertUsable(sql, 'after an error');
    });
  },

  async transactions() {
    const t = await createTable('tx');
    await withSql({}, async (sql) => {
      const err = await outcome(
        sql.begin(async (tx) => {
          await tx`INSERT INTO ${tx(t)} VALUES (${1}, 'rolled back')`;
          throw new Error('roll back');
        }),
        'rolled back block',
      );
      assert.equal(err && err.message, 'roll back');
      assert.equal(await directCount(t), 0, 'a rolled back insert landed');
      const results = await within(
        sql.begin((tx) => [
          tx`INSERT INTO ${tx(t)} VALUES (${2}, 'pipelined')`,
          tx`INSERT INTO ${tx(t)} VALUES (${3}, 'pipelined')`,
          tx`SELECT count(*)::int AS n FROM ${tx(t)}`,
        ]),
        WAIT_MS,
        'pipelined block',
      );
      assert.equal(results[2][0].n, 2);
      await within(
        sql.begin(async (tx) => {
          await tx`INSERT INTO ${tx(t)} VALUES (${4}, 'outer')`;
          const inner = await outcome(
            tx.savepoint((sp) => [sp`INSERT INTO ${sp(t)} VALUES (${5}, 'savepoint')`, sp`INSERT INTO ${sp(t)} VALUES (${2}, 'dup')`]),
            'savepoint',
          );
          assertCode(inner, '23505', 'savepoint');
          await tx.savepoint((sp) => sp`INSERT INTO ${sp(t)} VALUES (${6}, 'savepoint 2')`);
        }),
        WAIT_MS,
        'block with savepoints',
      );
      assert.deepEqual((await direct(`SELECT id FROM ${t} ORDER BY id`)).map((r) => r.id), [2, 3, 4, 6]);
      // A failed pipelined block rolls back as a whole.
      const failed = await outcome(
        sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${7}, 'lost')`, tx`INSERT INTO ${tx(t)} VALUES (${2}, 'dup')`]),
        'failed block',
      );
      assertCode(failed, '23505', 'failed block');
      assert.equal(await directCount(t), 4);
      await assertUsable(sql, 'after the failed block');
    });
  },

  // A token as startup parameters, in `options`, with SET, and in a statement comment:
  // writes land, and advance the fence where it is enforced.
  async token_sources() {
    const t = await createTable('sources');
    const res = resource('sources');
    await withSql({ 'fencing.token': '10', 'fencing.resource': res }, async (sql) => {
      assert.equal((await sql`SHOW fencing.token`)[0]['fencing.token'], '10');
      await within(sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${1}, 'parameters')`]), WAIT_MS, 'block');
      await assertFence(res, 10);
    });
    await withSql(tokenOptions(11, res), async (sql) => {
      assert.equal((await sql`SHOW fencing.resource`)[0]['fencing.resource'], res);
      await within(sql`INSERT INTO ${sql(t)} VALUES (${2}, 'options')`, WAIT_MS, 'insert');
      await assertFence(res, 11);
    });
    await withSql({}, async (sql) => {
      await sql.unsafe(`SET fencing.resource = '${res}'`);
      await sql`SET fencing.token = 12`;
      await within(sql`INSERT INTO ${sql(t)} VALUES (${3}, 'SET')`, WAIT_MS, 'insert');
      await assertFence(res, 12);
      await sql.unsafe(`/* fencing_token=13 fencing_resource=${res} */ INSERT INTO ${t} VALUES ($1, 'comment')`, [4]);
      await assertFence(res, 13);
    });
    assert.equal(await directCount(t), 4);
  },

  // A deposed leader (token 33 after 34): rejected with FN001 where the fence is enforced,
  // landing elsewhere; the connection stays usable.
  async stale_token() {
    const t = await createTable('stale');
    const res = resource('stale');
    await takeFence(t, res);
    await withSql(tokenOptions(TOKEN_A, res), async (sql) => {
      let err = await outcome(sql`INSERT INTO ${sql(t)} VALUES (${1}, 'A')`, 'autocommit');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'autocommit');
      await assertUsable(sql, 'after autocommit');
      // The same prepared statement again.
      err = await outcome(sql`INSERT INTO ${sql(t)} VALUES (${2}, 'A')`, 'autocommit again');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'autocommit, prepared again');
      err = await outcome(
        sql.begin((tx) => [
          tx`INSERT INTO ${tx(t)} VALUES (${3}, 'A pipelined')`,
          tx`INSERT INTO ${tx(t)} VALUES (${4}, 'A pipelined')`,
          tx`SELECT count(*)::int AS n FROM ${tx(t)}`,
        ]),
        'pipelined block',
      );
      expectStale(err, res, TOKEN_A, TOKEN_B, 'pipelined block');
      err = await outcome(
        sql.begin(async (tx) => {
          await tx`SELECT count(*) FROM ${tx(t)}`;
          await tx`UPDATE ${tx(t)} SET who = 'hijacked' WHERE id = ${-TOKEN_B}`;
        }),
        'block',
      );
      expectStale(err, res, TOKEN_A, TOKEN_B, 'block: read, then write');
      await assertUsable(sql, 'after the blocks');
      // Reads of a deposed leader are not fenced.
      assert.equal((await sql`SELECT count(*)::int AS n FROM ${sql(t)} WHERE id = ${-TOKEN_B}`)[0].n, 1);
    });
    await withSql({}, async (sql) => {
      await sql.unsafe(`SET fencing.resource = '${res}'`);
      await sql.unsafe(`SET fencing.token = ${TOKEN_A}`);
      const err = await outcome(sql`INSERT INTO ${sql(t)} VALUES (${5}, 'SET')`, 'SET');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'SET fencing.token');
      await sql.unsafe('RESET fencing.token; RESET fencing.resource').simple();
      const comment = `/* fencing_token=${TOKEN_A} fencing_resource=${res} */ INSERT INTO ${t} VALUES ($1, 'comment')`;
      expectStale(await outcome(sql.unsafe(comment, [6]), 'comment'), res, TOKEN_A, TOKEN_B, 'comment');
      await assertUsable(sql, 'after the comment');
    });
    assert.equal(await directCount(t, 'id > 0'), FENCED ? 0 : 6, 'stale rows landed (or not)');
    assert.equal(await directCount(t, "who = 'hijacked'"), FENCED ? 0 : 1);
    await assertFence(res, TOKEN_B);
  },

  // F1: the first write of a connection fails (a unique violation); the later writes must
  // work, and none may hang.
  async first_write_fails() {
    const t = await createTable('first', 'id int PRIMARY KEY');
    await direct(`INSERT INTO ${t} VALUES (1)`);
    const res = resource('first');
    for (const [connection, base] of [[{ application_name: 'pjs-first' }, 10], [tokenOptions(5, res), 100]]) {
      await withSql(connection, async (sql) => {
        assertCode(await outcome(sql`INSERT INTO ${sql(t)} VALUES (${1})`, 'first write'), '23505', 'first write');
        for (const id of [base + 1, base + 2]) await within(sql`INSERT INTO ${sql(t)} VALUES (${id})`, WAIT_MS, `insert ${id}`);
        await within(sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${base + 3})`]), WAIT_MS, 'block');
        // A first block that fails, then writes again.
        const failed = await outcome(sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${1})`, tx`INSERT INTO ${tx(t)} VALUES (${base + 9})`]), 'failed block');
        assertCode(failed, '23505', 'failed block');
        await within(sql`INSERT INTO ${sql(t)} VALUES (${base + 4})`, WAIT_MS, 'insert after the failed block');
      });
    }
    assert.equal(await directCount(t), 9);
  },

  // F3: 20 queries queued at once on one connection (pipelined), one failing in the middle:
  // only that one rejects, the others complete.
  async pipeline_error_mid_pipeline() {
    const t = await createTable('mid', 'id int PRIMARY KEY');
    const res = resource('mid');
    const settle = async (queries, what) =>
      (await within(Promise.allSettled(queries), WAIT_MS, what)).map((x) => (x.status === 'fulfilled' ? 'ok' : x.reason.code));
    const expected = (bad, code) => Array.from({ length: 20 }, (_, i) => (i === bad ? code : 'ok'));
    await withSql(tokenOptions(5, res), async (sql) => {
      for (const [kind, bad, code] of [
        ['division by zero', () => sql`SELECT 1/${0}::int AS x`, '22012'],
        ['syntax error', () => sql.unsafe('SELEC 1'), '42601'],
        ['unknown table', () => sql`SELECT * FROM pjs_no_such_table`, '42P01'],
      ]) {
        const got = await settle(Array.from({ length: 20 }, (_, i) => (i === 7 ? bad() : sql`SELECT ${i}::int AS i`)), kind);
        assert.deepEqual(got, expected(7, code), `reads, ${kind}`);
      }
      await sql`INSERT INTO ${sql(t)} VALUES (${-1})`;
      let got = await settle(Array.from({ length: 20 }, (_, i) => sql`INSERT INTO ${sql(t)} VALUES (${i === 7 ? -1 : i})`), 'writes');
      assert.deepEqual(got, expected(7, '23505'), 'writes, a duplicate in the middle');
      got = await settle(
        Array.from({ length: 20 }, (_, i) =>
          i === 7 ? sql`SELECT 1/${0}::int` : i % 2 ? sql`INSERT INTO ${sql(t)} VALUES (${100 + i}) RETURNING id` : sql`SELECT count(*) FROM ${sql(t)}`,
        ),
        'mixed',
      );
      assert.deepEqual(got, expected(7, '22012'), 'reads and writes, a division by zero in the middle');
      await assertUsable(sql, 'after the pipelines');
    });
    assert.equal(await directCount(t), 1 + 19 + 9);
    await assertFence(res, 5);
  },

  // F3 as found: a connection writes and ends; the next one with the same startup
  // parameters (pgfence may hand it the same server connection) queues 20 writes at once,
  // the first failing. None may hang.
  async pipeline_first_write_fails_reused_connection() {
    const t = await createTable('reuse', 'id int PRIMARY KEY');
    const res = resource('reuse');
    await direct(`INSERT INTO ${t} VALUES (-1)`);
    await withSql(tokenOptions(5, res), (sql) => within(sql`INSERT INTO ${sql(t)} VALUES (${-2})`, WAIT_MS, 'first connection'));
    await withSql(tokenOptions(5, res), async (sql) => {
      const got = (
        await within(
          Promise.allSettled(Array.from({ length: 20 }, (_, i) => sql`INSERT INTO ${sql(t)} VALUES (${i === 0 ? -1 : 200 + i})`)),
          WAIT_MS,
          '20 writes',
        )
      ).map((x) => (x.status === 'fulfilled' ? 'ok' : x.reason.code));
      assert.deepEqual(got, Array.from({ length: 20 }, (_, i) => (i === 0 ? '23505' : 'ok')));
      await within(sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${300})`]), WAIT_MS, 'block after');
    });
    assert.equal(await directCount(t), 2 + 19 + 1);
  },

  // F4: DISCARD PLANS, DEALLOCATE ALL (unprepared, so postgres.js has no statements to lose),
  // and a DISCARD ALL that fails in a block, then writes still work.
  async discard_then_writes() {
    const t = await createTable('discard', 'id int PRIMARY KEY');
    const res = resource('discard');
    let id = 0;
    const write = async (sql, context) => {
      id++;
      const err = await outcome(sql`INSERT INTO ${sql(t)} VALUES (${id})`, context);
      assert.equal(err, null, `write after ${context}: ${err && `${err.code} ${err.message}`}`);
    };
    await withSql(tokenOptions(5, res), async (sql) => {
      await write(sql, 'start');
      await sql`DISCARD PLANS`;
      await write(sql, 'DISCARD PLANS');
      const failed = await outcome(
        sql.begin(async (tx) => {
          await tx`INSERT INTO ${tx(t)} VALUES (${1000})`;
          await tx`DISCARD ALL`;
        }),
        'DISCARD ALL in a block',
      );
      assertCode(failed, '25001', 'DISCARD ALL in a block');
      await write(sql, 'a failed DISCARD ALL');
      await within(sql.begin((tx) => [tx`INSERT INTO ${tx(t)} VALUES (${2000})`]), WAIT_MS, 'block after');
    });
    await withSql(tokenOptions(5, res), async (sql) => {
      await write(sql, 'start unprepared');
      await sql`DEALLOCATE ALL`;
      await write(sql, 'DEALLOCATE ALL');
      await sql`DISCARD ALL`;
      await write(sql, 'DISCARD ALL');
    }, { prepare: false });
    assert.equal(await directCount(t), id + 1);
    await assertFence(res, 5);
  },

  // O1: COPY ... TO STDOUT of a table or of a read-only SELECT is a read: a deposed leader
  // may run it.
  async copy_to_stale() {
    const t = await createTable('copy_to');
    const res = resource('copy_to');
    await direct(`INSERT INTO ${t} VALUES (1, 'one'), (2, 'two')`);
    await takeFence(t, res);
    await withSql(tokenOptions(TOKEN_A, res), async (sql) => {
      for (const text of [`COPY ${t} TO STDOUT`, `COPY (SELECT id, who FROM ${t} ORDER BY id) TO STDOUT`]) {
        const chunks = [];
        const sink = new Writable({
          write(chunk, _enc, done) {
            chunks.push(chunk);
            done();
          },
        });
        const err = await outcome(
          (async () => pipeline(await sql.unsafe(text).readable(), sink))(),
          text,
        );
        assert.equal(err, null, `${text}: ${err && `${err.code} ${err.message}`}`);
        const lines = Buffer.concat(chunks).toString().split('\n').filter(Boolean).sort();
        assert.deepEqual(lines, ['-34\tB', '1\tone', '2\ttwo'], text);
      }
      await assertUsable(sql, 'after the COPYs');
    });
  },

  // F2: COPY FROM STDIN in a block of a deposed leader: a clean FN001, nothing landed.
  async copy_from_stale_in_transaction() {
    const t = await createTable('copy_stale');
    const res = resource('copy_stale');
    await takeFence(t, res);
    await withSql(tokenOptions(TOKEN_A, res), async (sql) => {
      const err = await outcome(
        sql.begin(async (tx) => {
          const writable = await tx`COPY ${tx(t)} FROM STDIN`.writable();
          await pipeline(Readable.from(['1\ta\n2\tb\n']), writable);
        }),
        'COPY FROM STDIN in a block',
      );
      expectStale(err, res, TOKEN_A, TOKEN_B, 'COPY FROM STDIN in a block');
      await assertUsable(sql, 'after the COPY');
    });
    assert.equal(await directCount(t, 'id > 0'), FENCED ? 0 : 2);
  },

  async cursor() {
    const t = await createTable('cursor');
    const res = resource('cursor');
    await takeFence(t, res);
    await withSql(tokenOptions(TOKEN_A, res), async (sql) => {
      let seen = 0;
      for await (const rows of sql`SELECT g FROM generate_series(1, ${1000}::int) g`.cursor(300)) {
        assert.equal(rows[0].g, seen + 1);
        seen += rows.length;
      }
      assert.equal(seen, 1000);
      // Stopped early, inside a block.
      await within(
        sql.begin(async (tx) => {
          const got = [];
          for await (const [row] of tx`SELECT g FROM generate_series(1, 100000) g`.cursor(1)) {
            got.push(row.g);
            if (got.length === 3) break;
          }
          assert.deepEqual(got, [1, 2, 3]);
          assert.equal((await tx`SELECT count(*)::int AS n FROM ${tx(t)}`)[0].n, 1);
        }),
        WAIT_MS,
        'cursor in a block',
      );
      await assertUsable(sql, 'after the cursors');
    });
  },

  async listen_notify() {
    const channel = uniqueName('pjs_chan', 'n');
    const listener = connect();
    const sender = connect();
    try {
      const received = [];
      let wake = () => {};
      const waitFor = (count) =>
        within(
          new Promise((resolve) => {
            wake = () => received.length >= count && resolve();
            wake();
          }),
          WAIT_MS,
          `${count} notifications`,
        );
      const { unlisten } = await within(
        listener.listen(channel, (payload) => {
          received.push(payload);
          wake();
        }),
        WAIT_MS,
        'LISTEN',
      );
      await sender.notify(channel, 'with parameters');
      await waitFor(1);
      await within(
        sender.begin(async (tx) => {
          await tx`SELECT pg_notify(${channel}, 'in a block')`;
          await new Promise((r) => setTimeout(r, 200));
          assert.equal(received.length, 1, 'delivered before COMMIT');
        }),
        WAIT_MS,
        'NOTIFY in a block',
      );
      await waitFor(2);
      assert.deepEqual(received, ['with parameters', 'in a block']);
      await within(unlisten(), WAIT_MS, 'UNLISTEN');
    } finally {
      await close(listener);
      await close(sender);
    }
  },

  // query.cancel() sends a CancelRequest: of a read, of a write, of a statement in a block;
  // the connection is usable after each. The cancel comes a second after the query, so
  // that on a loaded machine the statement runs by then (a CancelRequest that arrives
  // between statements cancels nothing: once, a direct run waited out its pg_sleep).
  async cancel() {
    const t = await createTable('cancel', 'id int PRIMARY KEY');
    const res = resource('cancel');
    const canceled = async (query, context) => {
      const started = Date.now();
      if (query.cancel) setTimeout(() => query.cancel(), 1000);
      assertCode(await outcome(query, context), '57014', context);
      assert.ok(Date.now() - started < 4000, `${context}: the cancel took too long`);
      // A cancel signal that reaches the server late (a loaded machine) cancels the
      // session's next statement if one runs by then, and nothing while it is idle: a CI
      // run's direct connection once got 57014 on the SELECT after the cancelled read.
      // Idle for a moment first, so that what is checked next is the session itself.
      await new Promise((resolve) => setTimeout(resolve, 500));
    };
    await withSql(tokenOptions(5, res), async (sql) => {
      await canceled(sql`SELECT pg_sleep(30)`, 'read');
      await assertUsable(sql, 'after cancelling a read');
      await canceled(sql`INSERT INTO ${sql(t)} SELECT 1 FROM pg_sleep(30)`, 'write');
      await within(sql`INSERT INTO ${sql(t)} VALUES (${2})`, WAIT_MS, 'write after');
      // The canceled statement fails the block, which is rolled back.
      await canceled(
        sql.begin(async (tx) => {
          await tx`INSERT INTO ${tx(t)} VALUES (${3})`;
          const sleep = tx`SELECT pg_sleep(30)`;
          setTimeout(() => sleep.cancel(), 1000);
          await sleep;
        }),
        'in a block',
      );
      await assertUsable(sql, 'after cancelling in a block');
    });
    assert.deepEqual((await direct(`SELECT id FROM ${t}`)).map((r) => r.id), [2]);
    await assertFence(res, 5);
  },
};

run(tests);
