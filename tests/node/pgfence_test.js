// Shared helpers of the Node.js driver test scripts in this directory (see README.md).
//
// A script builds an object of test functions `async name(target)` and ends with
// `run(tests)`: each test runs against `target` (pgfence when PGFENCE_DSN is set, else
// PostgreSQL directly) under a deadline, prints `ok <name> (<ms> ms)` or `FAIL <name>` (the
// stack goes to stderr), and the script exits 1 if any failed. A hang is a FAIL of that
// test, not a kill of the script.
'use strict';

const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const pg = require('pg');

// One test's deadline.
const DEADLINE_MS = 30000;
// A deadline for one wait inside a test (a query, a notification).
const WAIT_MS = 10000;
const TOKEN_A = 33;
const TOKEN_B = 34;

// A libpq key=value connection string as an object (quotes and backslash escapes as libpq
// reads them).
function parseConninfo(dsn) {
  const out = {};
  let i = 0;
  const n = dsn.length;
  while (i < n) {
    while (i < n && /\s/.test(dsn[i])) i++;
    if (i >= n) break;
    const eq = dsn.indexOf('=', i);
    if (eq < 0) throw new Error(`malformed connection string: ${dsn}`);
    const key = dsn.slice(i, eq).trim();
    i = eq + 1;
    while (i < n && /\s/.test(dsn[i])) i++;
    let value = '';
    if (dsn[i] === "'") {
      i++;
      while (i < n && dsn[i] !== "'") {
        if (dsn[i] === '\\') i++;
        value += dsn[i++];
      }
      i++;
    } else {
      while (i < n && !/\s/.test(dsn[i])) {
        if (dsn[i] === '\\') i++;
        value += dsn[i++];
      }
    }
    out[key] = value;
  }
  return out;
}

// Where to connect: host, port, user, database (password when given).
function endpoint(dsn) {
  const info = parseConninfo(dsn);
  const known = ['host', 'port', 'user', 'dbname', 'password', 'connect_timeout'];
  for (const key of Object.keys(info)) {
    assert.ok(known.includes(key), `connection parameter ${key} not mapped to the Node.js drivers`);
  }
  const out = { host: info.host, port: Number(info.port), user: info.user, database: info.dbname };
  if (info.password !== undefined) out.password = info.password;
  return out;
}

const directDsn = process.env.PG_DIRECT_DSN;
if (!directDsn) {
  console.error('PG_DIRECT_DSN is not set: run this script through harness::run_node');
  process.exit(2);
}
const proxyDsn = process.env.PGFENCE_DSN || null;
// PostgreSQL itself, to look behind pgfence's back.
const DIRECT = endpoint(directDsn);
// What the tests exercise.
const TARGET = endpoint(proxyDsn || directDsn);
// Whether stale writes must be rejected: through a pgfence that enforces fences
// (PGFENCE_FENCE `on`, the default when PGFENCE_DSN is set). Directly, or with the fence off,
// the same stale writes must land.
const FENCED = proxyDsn !== null && (process.env.PGFENCE_FENCE || 'on') === 'on';
const MODE = proxyDsn ? (FENCED ? 'fenced' : 'proxy') : 'direct';

// Rejects with a TIMEOUT error when `promise` has not settled within `ms`.
function within(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`TIMEOUT: ${what} did not finish within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// The error `promise` rejects with, or null when it resolves (within WAIT_MS).
async function outcome(promise, what) {
  try {
    await within(Promise.resolve(promise), WAIT_MS, what);
    return null;
  } catch (err) {
    if (String(err.message).startsWith('TIMEOUT')) throw err;
    return err;
  }
}

// A node-postgres client of `where` (TARGET by default), connected, with `extra` settings.
async function pgConnect(extra = {}, where = TARGET) {
  const client = new pg.Client({ ...where, ...extra });
  // An error of an idle client (e.g. its server going away) must fail a test, not the process.
  client.on('error', (err) => console.error(`client error: ${err.message}`));
  await within(client.connect(), WAIT_MS, 'connect');
  return client;
}

// node-postgres client settings that present `token` for `resource` at startup.
function tokenOptions(token, resource) {
  return { options: `-c fencing.token=${token} -c fencing.resource=${resource}` };
}

// Runs `text` directly on PostgreSQL, returning the rows.
async function direct(text, values) {
  const client = await pgConnect({}, DIRECT);
  try {
    return (await within(client.query(text, values), WAIT_MS, text)).rows;
  } finally {
    await client.end();
  }
}

async function directCount(table, where = 'true') {
  return Number((await direct(`SELECT count(*) AS n FROM ${table} WHERE ${where}`))[0].n);
}

// The fence of `resource` in pgfence's table (null: no fence row), read directly.
async function fenceOf(resource) {
  const rows = await direct('SELECT token::text AS token FROM pgfence.fences WHERE resource = $1', [resource]);
  return rows.length ? Number(rows[0].token) : null;
}

// The fence of `resource` is `token` when the fence is enforced; there is no fence row when
// it is not (directly, or fence off: nothing calls pgfence.check).
async function assertFence(resource, token) {
  assert.equal(await fenceOf(resource), FENCED ? token : null, `fence of ${resource}`);
}

// The exact FN001 of SPEC section 5.
function stale(resource, token, fence) {
  return {
    code: 'FN001',
    severity: 'ERROR',
    message: `stale fencing token ${token} for resource "${resource}": token ${fence} was already accepted`,
    detail:
      `A newer holder of the lease on "${resource}" has written with token ${fence}. ` +
      'This transaction was rolled back and none of its writes were applied.',
    hint:
      `This client is no longer the leader for "${resource}": stop writing, ` +
      'and re-acquire the lease to get a new token.',
  };
}

// `err` (a node-postgres or postgres.js server error) is exactly FN001 for `token` against
// `fence`, without pgfence's call stack.
function assertStale(err, resource, token, fence, context) {
  assert.ok(err, `${context}: no error, expected FN001`);
  const got = {
    code: err.code,
    severity: err.severity,
    message: err.message,
    detail: err.detail,
    hint: err.hint,
  };
  assert.deepEqual(got, stale(resource, token, fence), `${context}: not the FN001 of SPEC section 5`);
  assert.ok(!err.where, `${context}: pgfence's call stack leaked: ${err.where}`);
}

// Asserts `err` is the stale rejection when FENCED, and null (the write landed) otherwise.
function expectStale(err, resource, token, fence, context) {
  if (FENCED) {
    assertStale(err, resource, token, fence, context);
  } else {
    assert.equal(err, null, `${context}: a stale write must land ${MODE}: ${err && `${err.code} ${err.message}`}`);
  }
}

// Asserts `err` is a server error with SQLSTATE `code`.
function assertCode(err, code, context) {
  assert.ok(err, `${context}: no error, expected ${code}`);
  assert.equal(err.code, code, `${context}: ${err.message}`);
}

// Random per run: a process id alone may come back in a later run on the same database.
const RUN_ID = crypto.randomBytes(4).toString('hex');

// Names unique to this run and mode, so runs can share a database.
function uniqueName(prefix, name) {
  const out = `${prefix}_${name}_${RUN_ID}_${MODE}`;
  assert.ok(out.length <= 63, out);
  return out;
}

// The test running now, for an uncaught exception.
let current = null;

// Runs every test of `tests` (an object of async functions) in order, each under
// DEADLINE_MS, then exits. PGFENCE_NODE_ONLY (comma-separated names) runs only those, e.g.
// to repeat one test by hand.
async function run(tests) {
  let failed = 0;
  const only = (process.env.PGFENCE_NODE_ONLY || '').split(',').filter((n) => n !== '');
  for (const name of only) assert.ok(name in tests, `PGFENCE_NODE_ONLY: no test ${name}`);
  const names = only.length ? only : Object.keys(tests);
  for (const name of names) {
    const started = Date.now();
    current = name;
    try {
      await within(tests[name](), DEADLINE_MS, `test ${name}`);
      console.log(`ok ${name} (${Date.now() - started} ms)`);
    } catch (err) {
      failed++;
      console.log(`FAIL ${name}`);
      console.error(`FAIL ${name} (${MODE}):`, err && err.stack ? err.stack : err);
    }
  }
  console.log(`summary: ok=${names.length - failed} failed=${failed}`);
  // Connections a failed test left open must not keep the process alive.
  process.exit(failed ? 1 : 0);
}

// An error thrown outside any test's promise chain (a driver crashing on an unexpected
// message) fails the script loudly instead of passing silently.
process.on('uncaughtException', (err) => {
  console.log(`FAIL ${current} (uncaught exception)`);
  console.error(`FAIL ${current} (${MODE}): uncaught exception:`, err && err.stack ? err.stack : err);
  process.exit(1);
});

module.exports = {
  DIRECT,
  FENCED,
  MODE,
  TARGET,
  TOKEN_A,
  TOKEN_B,
  WAIT_MS,
  assertCode,
  assertFence,
  assertStale,
  direct,
  directCount,
  expectStale,
  fenceOf,
  outcome,
  pgConnect,
  run,
  tokenOptions,
  uniqueName,
  within,
};
