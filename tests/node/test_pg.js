// node-postgres (pg), pg-copy-streams and pg-cursor through pgfence (PGFENCE_DSN), and
// directly against PostgreSQL when PGFENCE_DSN is not set, so the expectations themselves are
// checked there.
//
// node-postgres sends a parameterized query as an unnamed Parse/Bind/Describe/Execute/Sync
// (a named one once per connection), a query without parameters as a simple Query; COPY
// streams go through pg-copy-streams, cursors (Execute with a row limit, PortalSuspended)
// through pg-cursor. PGFENCE_FENCE (see pgfence_test.js) says whether stale writes must be
// rejected (exact FN001, nothing landed) or must land.
'use strict';

const assert = require('node:assert/strict');
const { pipeline } = require('node:stream/promises');
const { Readable, Writable } = require('node:stream');
const { from: copyFrom, to: copyTo } = require('pg-copy-streams');
const Cursor = require('pg-cursor');
const pg = require('pg');
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
  pgConnect,
  run,
  tokenOptions,
  uniqueName,
  within,
} = require('./pgfence_test');

const table = (name) => uniqueName('njs', name);
const resource = (name) => uniqueName('njs', name).replace(/_/g, '.');

async function createTable(name, columns = 'id int PRIMARY KEY, who text') {
  const t = table(name);
  await direct(`CREATE TABLE ${t} (${columns})`);
  return t;
}

// A newer leader writes one row with `token` through the tested target, so the fence of
// `res` is `token` when it is enforced.
async function takeFence(t, res, token = TOKEN_B) {
  const b = await pgConnect(tokenOptions(token, res));
  try {
    await b.query(`INSERT INTO ${t} (id, who) VALUES ($1, 'B')`, [-token]);
  } finally {
    await b.end();
  }
  await assertFence(res, token);
}

// Runs `statements` (query arguments) in BEGIN ... COMMIT on `client`. Returns the first
// error (of a statement or of COMMIT), null when all succeeded; the session is idle after.
async function transaction(client, statements) {
  await client.query('BEGIN');
  let failure = null;
  for (const args of statements) {
    failure = await outcome(client.query(...args), args[0]);
    if (failure) break;
  }
  const commit = await outcome(client.query('COMMIT'), 'COMMIT');
  return failure || commit;
}

// The session is usable and idle (not in a failed transaction block).
async function assertUsable(client, context) {
  const r = await within(client.query('SELECT 1 AS one'), WAIT_MS, context);
  assert.deepEqual(r.rows, [{ one: 1 }], `${context}: session not usable`);
  assert.equal(client.getTransactionStatus(), 'I', `${context}: ReadyForQuery status`);
}

const tests = {
  async parameters() {
    const c = await pgConnect();
    try {
      const r = await c.query(
        'SELECT $1::int AS i, $2::text AS t, $3::text AS n, $4::jsonb AS j, $5::bytea AS b, $6::bigint AS big, $7::int[] AS arr',
        [42, "it's", null, { a: [1, 2] }, Buffer.from([0, 255]), '9223372036854775807', [1, 2, 3]],
      );
      assert.deepEqual(r.rows[0], {
        i: 42,
        t: "it's",
        n: null,
        j: { a: [1, 2] },
        b: Buffer.from([0, 255]),
        big: '9223372036854775807',
        arr: [1, 2, 3],
      });
      // A simple Query with several statements: one result per statement.
      const multi = await c.query('SELECT 1 AS a; SELECT 2 AS b');
      assert.deepEqual(multi.map((x) => x.rows), [[{ a: 1 }], [{ b: 2 }]]);
      // A named prepared statement: parsed once, then only bound.
      for (const v of [1, 2, 3]) {
        const named = await c.query({ name: 'njs_named', text: 'SELECT $1::int * 10 AS x', values: [v] });
        assert.deepEqual(named.rows, [{ x: v * 10 }]);
      }
      const arrays = await c.query({ text: 'SELECT 1 AS a, 2 AS b', rowMode: 'array' });
      assert.deepEqual(arrays.rows, [[1, 2]]);
      assertCode(await outcome(c.query('SELECT 1/$1::int', [0]), 'div0'), '22012', 'division by zero');
      await assertUsable(c, 'after an error');
    } finally {
      await c.end();
    }
  },

  async transactions() {
    const t = await createTable('tx');
    const c = await pgConnect();
    try {
      await c.query('BEGIN');
      await c.query(`INSERT INTO ${t} VALUES ($1, 'rolled back')`, [1]);
      await c.query('ROLLBACK');
      assert.equal(await directCount(t), 0, 'a rolled back insert landed');
      await c.query('BEGIN');
      await c.query(`INSERT INTO ${t} VALUES ($1, 'committed')`, [2]);
      assert.equal(await directCount(t), 0, 'visible before COMMIT');
      await c.query('SAVEPOINT s');
      assertCode(await outcome(c.query(`INSERT INTO ${t} VALUES ($1, 'dup')`, [2]), 'dup'), '23505', 'dup');
      await c.query('ROLLBACK TO SAVEPOINT s');
      await c.query(`INSERT INTO ${t} VALUES ($1, 'after savepoint')`, [3]);
      assert.equal((await c.query('COMMIT')).command, 'COMMIT');
      assert.equal(await directCount(t), 2);
      // A failed block: COMMIT is a ROLLBACK.
      await c.query('BEGIN');
      await c.query(`INSERT INTO ${t} VALUES ($1, 'lost')`, [4]);
      assertCode(await outcome(c.query(`INSERT INTO ${t} VALUES ($1, 'dup')`, [2]), 'dup'), '23505', 'dup');
      assertCode(await outcome(c.query('SELECT 1'), 'in failed block'), '25P02', 'in failed block');
      assert.equal((await c.query('COMMIT')).command, 'ROLLBACK');
      assert.equal(await directCount(t), 2);
      await assertUsable(c, 'after the failed block');
    } finally {
      await c.end();
    }
  },

  // A token at startup (`options`), with SET, and in a statement comment: writes land, and
  // advance the fence where it is enforced.
  async token_sources() {
    const t = await createTable('sources');
    const res = resource('sources');
    const a = await pgConnect(tokenOptions(10, res));
    try {
      assert.equal((await a.query('SHOW fencing.token')).rows[0]['fencing.token'], '10');
      assert.equal((await a.query('SHOW fencing.resource')).rows[0]['fencing.resource'], res);
      assert.equal(await transaction(a, [[`INSERT INTO ${t} VALUES ($1, 'options')`, [1]]]), null);
      await a.query(`INSERT INTO ${t} VALUES ($1, 'options autocommit')`, [2]);
      await assertFence(res, 10);
    } finally {
      await a.end();
    }
    const s = await pgConnect();
    try {
      await s.query(`SET fencing.resource = '${res}'`);
      await s.query('SET fencing.token = 11');
      await s.query(`INSERT INTO ${t} VALUES ($1, 'SET')`, [3]);
      await assertFence(res, 11);
    } finally {
      await s.end();
    }
    const m = await pgConnect();
    try {
      await m.query(`/* fencing_token=12 fencing_resource=${res} */ INSERT INTO ${t} VALUES ($1, 'comment')`, [4]);
      await m.query(`INSERT INTO ${t} VALUES (5, 'sqlcommenter') /*fencing_resource='${res}',fencing_token='13'*/`);
      await assertFence(res, 13);
    } finally {
      await m.end();
    }
    assert.equal(await directCount(t), 5);
  },

  // A deposed leader (token 33 after 34): every kind of write is rejected with FN001 where
  // the fence is enforced, and lands elsewhere; the session stays usable.
  async stale_token() {
    const t = await createTable('stale');
    const res = resource('stale');
    await takeFence(t, res);
    const a = await pgConnect(tokenOptions(TOKEN_A, res));
    try {
      let err = await outcome(a.query(`INSERT INTO ${t} VALUES ($1, 'A param')`, [1]), 'param');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'autocommit, parameters');
      await assertUsable(a, 'after autocommit');
      err = await outcome(a.query(`INSERT INTO ${t} VALUES (2, 'A simple')`), 'simple');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'autocommit, simple');
      err = await outcome(a.query({ name: 'njs_stale', text: `INSERT INTO ${t} VALUES ($1, 'A named')`, values: [3] }), 'named');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'named statement');
      // An explicit transaction: rejected at the write (fast path) or at COMMIT.
      err = await transaction(a, [
        [`SELECT count(*) FROM ${t}`],
        [`INSERT INTO ${t} VALUES ($1, 'A tx')`, [4]],
        [`UPDATE ${t} SET who = 'hijacked' WHERE id = $1`, [-TOKEN_B]],
      ]);
      expectStale(err, res, TOKEN_A, TOKEN_B, 'explicit transaction');
      await assertUsable(a, 'after the transaction');
      // Reads of a deposed leader are not fenced.
      assert.equal((await a.query(`SELECT count(*)::int AS n FROM ${t} WHERE id = $1`, [-TOKEN_B])).rows[0].n, 1);
    } finally {
      await a.end();
    }
    // The same token from SET, and from a comment.
    const s = await pgConnect();
    try {
      await s.query(`SET fencing.resource = '${res}'`);
      await s.query(`SET fencing.token = ${TOKEN_A}`);
      const err = await outcome(s.query(`INSERT INTO ${t} VALUES ($1, 'SET')`, [5]), 'SET');
      expectStale(err, res, TOKEN_A, TOKEN_B, 'SET fencing.token');
      await assertUsable(s, 'after SET');
    } finally {
      await s.end();
    }
    const m = await pgConnect();
    try {
      const err = await outcome(
        m.query(`/* fencing_token=${TOKEN_A} fencing_resource=${res} */ INSERT INTO ${t} VALUES ($1, 'comment')`, [6]),
        'comment',
      );
      expectStale(err, res, TOKEN_A, TOKEN_B, 'comment');
      await assertUsable(m, 'after the comment');
    } finally {
      await m.end();
    }
    assert.equal(await directCount(t, 'id > 0'), FENCED ? 0 : 6, 'stale rows landed (or not)');
    assert.equal(await directCount(t, "who = 'hijacked'"), FENCED ? 0 : 1);
    await assertFence(res, TOKEN_B);
  },

  // F1: the first write of a session fails (a unique violation); the later writes of the
  // session, extended and simple, autocommit and in blocks, must work.
  async first_write_fails() {
    const t = await createTable('first', 'id int PRIMARY KEY');
    await direct(`INSERT INTO ${t} VALUES (1)`);
    const res = resource('first');
    for (const options of [{ application_name: 'njs-first' }, tokenOptions(5, res)]) {
      const c = await pgConnect(options);
      const base = options.options ? 100 : 10;
      try {
        assertCode(await outcome(c.query(`INSERT INTO ${t} VALUES ($1)`, [1]), 'dup'), '23505', 'first write');
        await c.query(`INSERT INTO ${t} VALUES ($1)`, [base + 1]);
        await c.query(`INSERT INTO ${t} VALUES ($1)`, [base + 2]);
        await c.query(`INSERT INTO ${t} VALUES (${base + 3})`);
        assert.equal(await transaction(c, [[`INSERT INTO ${t} VALUES ($1)`, [base + 4]]]), null);
        assert.equal(await transaction(c, [[`INSERT INTO ${t} VALUES (${base + 5})`]]), null);
        // A first transaction that fails, then writes again.
        assertCode(await transaction(c, [[`INSERT INTO ${t} VALUES ($1)`, [1]]]), '23505', 'failed block');
        await c.query(`INSERT INTO ${t} VALUES ($1)`, [base + 6]);
      } finally {
        await c.end();
      }
    }
    assert.equal(await directCount(t), 13);
  },

  // F2: COPY FROM STDIN in a transaction of a deposed leader: a clean FN001 (at the COPY or
  // at COMMIT), no driver crash, nothing landed, the session usable.
  async copy_from_stale_in_transaction() {
    const t = await createTable('copy_stale');
    const res = resource('copy_stale');
    await takeFence(t, res);
    const a = await pgConnect(tokenOptions(TOKEN_A, res));
    try {
      await a.query('BEGIN');
      const stream = a.query(copyFrom(`COPY ${t} FROM STDIN`));
      const copyErr = await outcome(pipeline(Readable.from(['1\ta\n2\tb\n']), stream), 'COPY FROM STDIN');
      const commit = await within(a.query('COMMIT').then((r) => r.command, (e) => e), WAIT_MS, 'COMMIT');
      const err = copyErr || (typeof commit === 'string' ? null : commit);
      expectStale(err, res, TOKEN_A, TOKEN_B, 'COPY FROM STDIN in a transaction');
      if (copyErr) assert.equal(commit, 'ROLLBACK', 'COMMIT of the failed block');
      if (!FENCED) assert.equal(stream.rowCount, 2);
      await assertUsable(a, 'after the COPY');
    } finally {
      await a.end();
    }
    assert.equal(await directCount(t, 'id > 0'), FENCED ? 0 : 2);
  },

  async copy() {
    const t = await createTable('copy');
    const c = await pgConnect();
    try {
      const rows = Array.from({ length: 2000 }, (_, i) => `${i}\trow ${i}\\t\n`);
      const stream = c.query(copyFrom(`COPY ${t} FROM STDIN`));
      await within(pipeline(Readable.from(rows), stream), WAIT_MS, 'COPY FROM STDIN');
      assert.equal(stream.rowCount, 2000);
      assert.equal(await directCount(t), 2000);
      const chunks = [];
      const sink = new Writable({
        write(chunk, _enc, done) {
          chunks.push(chunk);
          done();
        },
      });
      await within(pipeline(c.query(copyTo(`COPY (SELECT id, who FROM ${t} WHERE id < 3 ORDER BY id) TO STDOUT WITH (FORMAT csv)`)), sink), WAIT_MS, 'COPY TO STDOUT');
      assert.equal(Buffer.concat(chunks).toString(), '0,row 0\t\n1,row 1\t\n2,row 2\t\n');
      // Bad data mid-stream: the COPY fails, nothing lands, the session goes on.
      const bad = c.query(copyFrom(`COPY ${t} FROM STDIN`));
      const err = await outcome(pipeline(Readable.from(['5000\tok\n', 'not a number\tbad\n']), bad), 'bad COPY');
      assertCode(err, '22P02', 'bad COPY data');
      assert.equal(await directCount(t), 2000);
      await assertUsable(c, 'after the failed COPY');
    } finally {
      await c.end();
    }
  },

  // O1: COPY ... TO STDOUT of a table or of a read-only SELECT is a read: a deposed leader
  // may run it.
  async copy_to_stale() {
    const t = await createTable('copy_to');
    const res = resource('copy_to');
    await direct(`INSERT INTO ${t} VALUES (1, 'one'), (2, 'two')`);
    await takeFence(t, res);
    const a = await pgConnect(tokenOptions(TOKEN_A, res));
    try {
      for (const text of [`COPY ${t} TO STDOUT`, `COPY (SELECT id, who FROM ${t} ORDER BY id) TO STDOUT`]) {
        for (const inBlock of [false, true]) {
          if (inBlock) await a.query('BEGIN');
          const chunks = [];
          const sink = new Writable({
            write(chunk, _enc, done) {
              chunks.push(chunk);
              done();
            },
          });
          const err = await outcome(pipeline(a.query(copyTo(text)), sink), text);
          assert.equal(err, null, `${text}${inBlock ? ' in a block' : ''}: ${err && `${err.code} ${err.message}`}`);
          const lines = Buffer.concat(chunks).toString().split('\n').filter(Boolean).sort();
          assert.deepEqual(lines, ['-34\tB', '1\tone', '2\ttwo']);
          if (inBlock) assert.equal((await a.query('COMMIT')).command, 'COMMIT');
        }
      }
      await assertUsable(a, 'after the COPYs');
    } finally {
      await a.end();
    }
  },

  // F4: statements that drop prepared statements or plans, and a DISCARD ALL that fails,
  // then writes of a fenced session still work.
  async discard_then_writes() {
    const t = await createTable('discard', 'id int PRIMARY KEY');
    const res = resource('discard');
    const c = await pgConnect(tokenOptions(5, res));
    let id = 0;
    const write = async (context) => {
      id++;
      const err = await outcome(c.query(`INSERT INTO ${t} VALUES ($1)`, [id]), context);
      assert.equal(err, null, `write after ${context}: ${err && `${err.code} ${err.message}`}`);
      await c.query(`INSERT INTO ${t} VALUES (${1000 + id})`);
    };
    try {
      await write('start');
      await c.query({ name: 'njs_mine', text: 'SELECT $1::int AS x', values: [1] });
      for (const text of ['DISCARD PLANS', 'DISCARD TEMP', 'DISCARD SEQUENCES', 'DEALLOCATE njs_mine', 'DEALLOCATE ALL', 'DISCARD ALL']) {
        await c.query(text);
        await write(text);
      }
      // DISCARD ALL cannot run in a transaction block: it fails, nothing is discarded.
      await c.query('BEGIN');
      assertCode(await outcome(c.query('DISCARD ALL'), 'DISCARD ALL in a block'), '25001', 'DISCARD ALL in a block');
      await c.query('ROLLBACK');
      await write('a failed DISCARD ALL');
      assertCode(await outcome(c.query('DISCARD ALL; SELECT 1'), 'DISCARD ALL; SELECT 1'), '25001', 'DISCARD ALL in a multi-statement Query');
      await write('DISCARD ALL; SELECT 1');
      const r = await c.query(`DISCARD PLANS; DEALLOCATE ALL; INSERT INTO ${t} VALUES (500)`);
      assert.deepEqual(r.map((x) => x.command), ['DISCARD', 'DEALLOCATE', 'INSERT']);
      await write('DISCARD PLANS; DEALLOCATE ALL; INSERT');
      assert.equal(await transaction(c, [[`INSERT INTO ${t} VALUES ($1)`, [600]]]), null);
    } finally {
      await c.end();
    }
    assert.equal(await directCount(t), 2 * id + 2);
    await assertFence(res, 5);
  },

  async cursor() {
    const res = resource('cursor');
    const t = await createTable('cursor');
    await takeFence(t, res);
    // A deposed leader's reads: cursors in and out of blocks.
    const c = await pgConnect(tokenOptions(TOKEN_A, res));
    try {
      const cursor = c.query(new Cursor('SELECT g FROM generate_series(1, $1::int) g', [1000]));
      let seen = 0;
      for (;;) {
        const rows = await within(cursor.read(300), WAIT_MS, 'cursor read');
        if (rows.length === 0) break;
        assert.equal(rows[0].g, seen + 1);
        seen += rows.length;
      }
      assert.equal(seen, 1000);
      await cursor.close();
      await c.query('BEGIN');
      const early = c.query(new Cursor(`SELECT g, 'x' || g AS s FROM generate_series(1, 100000) g`));
      assert.deepEqual(await within(early.read(2), WAIT_MS, 'cursor read'), [{ g: 1, s: 'x1' }, { g: 2, s: 'x2' }]);
      await within(early.close(), WAIT_MS, 'cursor close');
      assert.equal((await c.query(`SELECT count(*)::int AS n FROM ${t}`)).rows[0].n, 1);
      assert.equal((await c.query('COMMIT')).command, 'COMMIT');
      await assertUsable(c, 'after the cursors');
    } finally {
      await c.end();
    }
  },

  async listen_notify() {
    const channel = uniqueName('njs_chan', 'n');
    const listener = await pgConnect();
    const sender = await pgConnect();
    try {
      const received = [];
      let wake = () => {};
      listener.on('notification', (n) => {
        received.push([n.channel, n.payload]);
        wake();
      });
      const waitFor = (count) =>
        within(
          new Promise((resolve) => {
            wake = () => received.length >= count && resolve();
            wake();
          }),
          WAIT_MS,
          `${count} notifications`,
        );
      await listener.query(`LISTEN ${channel}`);
      await sender.query('SELECT pg_notify($1, $2)', [channel, 'with parameters']);
      await waitFor(1);
      await sender.query('BEGIN');
      await sender.query(`NOTIFY ${channel}, 'in a block'`);
      await new Promise((r) => setTimeout(r, 200));
      assert.equal(received.length, 1, 'delivered before COMMIT');
      await sender.query('COMMIT');
      await waitFor(2);
      assert.deepEqual(received, [[channel, 'with parameters'], [channel, 'in a block']]);
      await listener.query(`UNLISTEN ${channel}`);
      await assertUsable(listener, 'listener');
    } finally {
      await listener.end();
      await sender.end();
    }
  },

  // A CancelRequest (pg's Client#cancel), of a read and of a write in a fenced block; the
  // session is usable after each.
  async cancel() {
    const t = await createTable('cancel', 'id int PRIMARY KEY');
    const res = resource('cancel');
    const c = await pgConnect(tokenOptions(5, res));
    const cancelSoon = () =>
      setTimeout(() => {
        new pg.Client(TARGET).cancel(c, c.activeQuery);
      }, 300);
    try {
      let started = Date.now();
      const read = c.query('SELECT pg_sleep(30)');
      cancelSoon();
      assertCode(await outcome(read, 'canceled read'), '57014', 'canceled read');
      assert.ok(Date.now() - started < 4000, 'the cancel took too long');
      await assertUsable(c, 'after cancelling a read');
      await c.query('BEGIN');
      await c.query(`INSERT INTO ${t} VALUES ($1)`, [1]);
      started = Date.now();
      const write = c.query(`INSERT INTO ${t} SELECT 2 FROM pg_sleep(30)`);
      cancelSoon();
      assertCode(await outcome(write, 'canceled write'), '57014', 'canceled write');
      assert.ok(Date.now() - started < 4000, 'the cancel took too long');
      assert.equal((await c.query('COMMIT')).command, 'ROLLBACK');
      await c.query(`INSERT INTO ${t} VALUES ($1)`, [3]);
      await assertUsable(c, 'after cancelling a write');
    } finally {
      await c.end();
    }
    assert.deepEqual((await direct(`SELECT id FROM ${t}`)).map((r) => r.id), [3]);
    await assertFence(res, 5);
  },
};

run(tests);
