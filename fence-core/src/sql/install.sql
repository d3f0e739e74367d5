-- pgfence: the fencing schema in the upstream database.
--
-- Idempotent and upgradable: every object is created with IF NOT EXISTS or
-- CREATE OR REPLACE, columns added by later versions use ADD COLUMN IF NOT EXISTS, and the
-- whole script runs in one transaction serialised by an advisory lock, so two proxies
-- starting at once (or `pgfence install` racing a proxy) cannot interleave.
--
-- Placeholders substituted by fence_core::sql::install_sql():
--   __PGFENCE_SCHEMA_VERSION__  the schema version of this script
--   __PGFENCE_GRANTEE__         the role granted EXECUTE/SELECT (PUBLIC or a quoted name)
--   __PGFENCE_ACCEPT_LOCK__     'advisory' or 'row' (see schema_version.accept_lock)
--   __PGFENCE_ACCEPT_ADVISORY__ true for 'advisory', false for 'row'
--
-- The locking scheme of pgfence.check() is explained in docs/fence-locking.md and in the
-- comment block inside the function.

BEGIN;

-- Re-running the script is normal: no "already exists, skipping" notices.
SET LOCAL client_min_messages = warning;

-- 'pgfence' as a big-endian integer: one install at a time per database.
DO $lock$ BEGIN PERFORM pg_catalog.pg_advisory_xact_lock(31638886877651813); END $lock$;

CREATE SCHEMA IF NOT EXISTS pgfence;

-- One row per installation; refuses to downgrade a schema installed by a newer pgfence.
CREATE TABLE IF NOT EXISTS pgfence.schema_version (
    singleton    boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    version      integer     NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

DO $version$
DECLARE
    v_installed integer;
BEGIN
    SELECT v.version INTO v_installed FROM pgfence.schema_version AS v;
    IF v_installed > __PGFENCE_SCHEMA_VERSION__ THEN
        RAISE EXCEPTION 'pgfence schema version % is installed, this pgfence installs version %',
                v_installed, __PGFENCE_SCHEMA_VERSION__
            USING HINT = 'Upgrade pgfence: a schema is never downgraded.';
    END IF;
END
$version$;

-- How transactions that accept a fence lock it (docs/fence-locking.md, "Accept locks"):
-- 'advisory' (a shared transaction-level advisory lock under READ COMMITTED), or 'row'
-- (FOR SHARE on the fence row at every level: what schema versions before 4 did, kept by
-- an upgrade until every transaction that may still run the old code has ended).
ALTER TABLE pgfence.schema_version ADD COLUMN IF NOT EXISTS accept_lock text NOT NULL DEFAULT 'row';

INSERT INTO pgfence.schema_version AS v (singleton, version, installed_at, accept_lock)
VALUES (true, __PGFENCE_SCHEMA_VERSION__, pg_catalog.now(), '__PGFENCE_ACCEPT_LOCK__')
ON CONFLICT (singleton) DO UPDATE
    SET version = excluded.version, installed_at = excluded.installed_at,
        accept_lock = excluded.accept_lock;

COMMENT ON SCHEMA pgfence IS
    'pgfence fencing state (schema version __PGFENCE_SCHEMA_VERSION__): fences, their history, the check function';

-- The fence of each resource: the highest token accepted so far. Rows are never deleted
-- and tokens never decrease (only pgfence.check writes here; the guard trigger below stops
-- accidents by the owner too).
CREATE TABLE IF NOT EXISTS pgfence.fences (
    resource   text        PRIMARY KEY,
    token      bigint      NOT NULL,
    updated_at timestamptz NOT NULL
);
COMMENT ON TABLE pgfence.fences IS
    'Highest fencing token accepted per resource. Written only by pgfence.check().';

-- Append-only log of fence advances (including the first token of a resource).
CREATE TABLE IF NOT EXISTS pgfence.history (
    id             bigserial   PRIMARY KEY,
    resource       text        NOT NULL,
    previous_token bigint,
    new_token      bigint      NOT NULL,
    advanced_at    timestamptz NOT NULL DEFAULT pg_catalog.now(),
    db_user        text        NOT NULL DEFAULT session_user,
    client_addr    text
);
-- Columns added after schema version 1 go here, as ADD COLUMN IF NOT EXISTS.
ALTER TABLE pgfence.history ADD COLUMN IF NOT EXISTS client_addr text;
CREATE INDEX IF NOT EXISTS history_resource_idx ON pgfence.history (resource, id);
COMMENT ON TABLE pgfence.history IS
    'Append-only log of fence advances: previous_token is NULL for the first token of a resource.';

-- Guards: fences never move backwards and are never deleted; history is never rewritten.
-- (TRUNCATE, by the owner only, remains the deliberate way to reset a test database.)
CREATE OR REPLACE FUNCTION pgfence.guard_fences() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $guard$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'pgfence fence rows are never deleted (resource "%")', OLD.resource;
    END IF;
    IF NEW.resource IS DISTINCT FROM OLD.resource OR NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence fences never move backwards (resource "%": % to %)',
                OLD.resource, OLD.token, NEW.token;
    END IF;
    RETURN NEW;
END
$guard$;

CREATE OR REPLACE FUNCTION pgfence.guard_history() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $guard$
BEGIN
    RAISE EXCEPTION 'pgfence.history is append-only';
END
$guard$;

DROP TRIGGER IF EXISTS fences_guard ON pgfence.fences;
CREATE TRIGGER fences_guard BEFORE UPDATE OR DELETE ON pgfence.fences
    FOR EACH ROW EXECUTE FUNCTION pgfence.guard_fences();
DROP TRIGGER IF EXISTS history_guard ON pgfence.history;
CREATE TRIGGER history_guard BEFORE UPDATE OR DELETE ON pgfence.history
    FOR EACH ROW EXECUTE FUNCTION pgfence.guard_history();

-- FN001, in one place: pgfence.check and pgfence.fast_reject must produce identical text
-- (the proxy's Rust code produces and parses the same).
CREATE OR REPLACE FUNCTION pgfence.raise_stale(p_resource text, p_token bigint, p_fence bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $stale$
DECLARE
    v_r text := pg_catalog.translate(pg_catalog.left(p_resource, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??');
    v_f text := coalesce(p_fence::text, 'unknown');
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'FN001',
        MESSAGE = pg_catalog.format(
            'stale fencing token %s for resource "%s": token %s was already accepted',
            p_token, v_r, v_f),
        DETAIL = pg_catalog.format(
            'A newer holder of the lease on "%s" has written with token %s. This transaction was rolled back and none of its writes were applied.',
            v_r, v_f),
        HINT = pg_catalog.format(
            'This client is no longer the leader for "%s": stop writing, and re-acquire the lease to get a new token.',
            v_r);
END
$stale$;

CREATE OR REPLACE FUNCTION pgfence.check_write(
    p_resources      text[],
    p_tokens         text[],
    p_default_resource text,
    p_allow_missing  text[],
    p_client         text,
    p_force          boolean)
RETURNS text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $check$
-- Runs inside the client's transaction right before it commits. Returns the accepted
-- `resource=token` pairs (sorted, comma-separated) or NULL; rejects by raising FN001,
-- FN002 or FN003, which aborts the transaction.
--
-- LOCKING (see docs/fence-locking.md). Invariant: for each resource, committed write
-- transactions have non-decreasing tokens in commit order, and none commits with a token
-- below the fence at its commit. Every accepting path ends holding a lock on the resource
-- until the transaction ends, after having compared the token with the value read under
-- that lock ("accept lock"):
--   * same or older token (t <= value read), READ COMMITTED: a shared transaction-level
--     advisory lock on the resource's key, then a plain read (a fresh snapshot, taken
--     after the lock was granted). Shared locks do not conflict with each other, so the
--     current leader's concurrent transactions never queue behind each other, and unlike
--     FOR SHARE nothing is written (no WAL, no MultiXact).
--   * same or older token, REPEATABLE READ / SERIALIZABLE (and every level while
--     schema_version.accept_lock = 'row'): SELECT ... FOR SHARE, whose locking read cannot
--     miss an advance committed after the snapshot (it raises 40001 instead).
--   * newer token (t > value read): the exclusive advisory lock, then SELECT ... FOR NO KEY
--     UPDATE, then UPDATE. The advisory lock waits for every advisory accept lock, the row
--     lock for every FOR SHARE: an advance waits until every in-flight transaction that
--     accepted the old token has ended (they commit before the advance: their tokens
--     precede it in commit order), and every transaction that locks after the advance sees
--     the new value and is rejected if older. Two advancers serialise on the locks; the
--     second re-reads the first one's value and is rejected, accepts, or advances further.
--   * no row yet: INSERT ... ON CONFLICT DO NOTHING. The uniqueness check makes a racing
--     inserter wait for us; if we lose, we re-read the committed row and go through the
--     locked paths above.
-- Each call takes exactly one lock mode per resource, chosen from an unlocked read, and
-- never upgrades shared to exclusive (two share holders both upgrading would deadlock).
-- Resources are locked in sorted order, so multi-resource transactions cannot deadlock
-- with each other on fences. The advisory key is a 64-bit hash of the resource name.
-- Under REPEATABLE READ / SERIALIZABLE the unlocked read sees the transaction snapshot;
-- if a newer fence was committed after it, the locking read (or ON CONFLICT against an
-- invisible row) raises 40001 instead of returning the stale version: never a stale commit.
-- No EXCEPTION blocks here: they would start a subtransaction on every call.
DECLARE
    v_t_s      text;             -- fencing.token of the session
    v_r0       text;             -- the session's effective resource
    v_client   text;
    v_n        integer;
    v_idx      integer;
    v_r        text;
    v_t        text;
    v_norm     text;
    v_names    text[] := '{}';   -- resources in order of first appearance
    v_raws     text[] := '{}';   -- raw token per resource (NULL = none given)
    v_norms    text[] := '{}';   -- token without leading zeros, to compare for conflicts
    v_sorted   text[] := '{}';   -- validated resources that carry a token, sorted
    v_tokens   bigint[] := '{}'; -- their tokens
    v_token    bigint;
    v_seen     bigint;
    v_locked   bigint;
    v_accepted text[] := '{}';
    v_found    boolean;
    v_adv      boolean;          -- accept under a shared advisory lock, not FOR SHARE
BEGIN
    -- The common case, on every transaction through the proxy: nothing written, nothing to do.
    IF NOT coalesce(p_force, false)
       AND pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN NULL;
    END IF;
    v_r0 := coalesce(nullif(pg_catalog.current_setting('fencing.resource', true), ''),
                     p_default_resource);
    v_t_s := nullif(pg_catalog.current_setting('fencing.token', true), '');

    -- Advisory accept locks need each statement's fresh snapshot: READ COMMITTED only.
    v_adv := __PGFENCE_ACCEPT_ADVISORY__
             AND pg_catalog.current_setting('transaction_isolation') = 'read committed';


    -- Fast path, the common case of a fenced session: no comment directives, one resource
    -- and one well-formed token, a fence row that already holds this token or a newer one.
    -- Same accept lock as the general path below (chosen from an unlocked read), without
    -- its bookkeeping. Anything else takes the general path.
    IF coalesce(pg_catalog.cardinality(p_resources), 0) = 0
       AND coalesce(pg_catalog.cardinality(p_tokens), 0) = 0
       AND v_r0 IS NOT NULL AND v_t_s IS NOT NULL
       AND pg_catalog.length(v_t_s) <= 18 AND v_t_s ~ '^[0-9]+$'
       AND v_r0 ~ '^[A-Za-z0-9_.:-]{1,63}$' THEN
        v_token := v_t_s::bigint;
        -- v_found: the accepted-token hint matched. This backend accepted this very token
        -- for this resource before, so the fence is at least this token (fences only
        -- grow): the share lock is the right one without the unlocked read. The setting is
        -- only a hint: if it is wrong (a client may set it), the fence is below the token,
        -- and since a share lock must not be upgraded, the transaction fails with a
        -- retryable serialization error.
        v_found := coalesce(pg_catalog.current_setting('pgfence.accepted', true) = v_r0 || '=' || v_t_s,
                            false);
        IF v_found THEN
            v_seen := v_token;
        ELSE
            SELECT f.token INTO v_seen FROM pgfence.fences AS f WHERE f.resource = v_r0;
        END IF;
        IF v_seen IS NOT NULL AND v_token <= v_seen THEN
            IF v_adv THEN
                PERFORM pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtextextended(v_r0, 31638886877651813));
                SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource = v_r0;
            ELSE
                SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource = v_r0 FOR SHARE;
            END IF;
            IF v_locked IS NULL OR v_locked < v_token THEN
                RAISE EXCEPTION USING
                    ERRCODE = '40001',
                    MESSAGE = pg_catalog.format(
                        'pgfence: the fence of resource "%s" is below token %s; retry the transaction', v_r0, v_t_s);
            END IF;
            IF v_token < v_locked THEN
                PERFORM pgfence.raise_stale(v_r0, v_token, v_locked);
            END IF;
            IF NOT v_found THEN
                -- Remember the accepted token (undone with the transaction if it rolls back).
                PERFORM pg_catalog.set_config('pgfence.accepted', v_r0 || '=' || v_t_s, false);
            END IF;
            RETURN v_r0 || '=' || v_token::text;
        END IF;
    END IF;

    v_client := coalesce(p_client, pg_catalog.host(pg_catalog.inet_client_addr()));

    -- 1. Resolve each directive against the session, group by resource.
    v_n := greatest(coalesce(pg_catalog.array_length(p_resources, 1), 0),
                               coalesce(pg_catalog.array_length(p_tokens, 1), 0));
    FOR i IN 1 .. v_n LOOP
        v_r := coalesce(p_resources[i], v_r0);
        v_t := coalesce(p_tokens[i], v_t_s);
        CONTINUE WHEN v_r IS NULL AND v_t IS NULL;
        IF v_r IS NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FN003',
                MESSAGE = pg_catalog.format(
                    'fencing token %s has no resource: set fencing.resource or add fencing_resource to the comment',
                    pg_catalog.translate(pg_catalog.left(v_t, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??')),
                DETAIL = 'This transaction was rolled back.',
                HINT = 'Fencing tokens are integers from 0 to 9223372036854775807; resources are 1 to 63 characters from [A-Za-z0-9_.:-].';
        END IF;
        v_norm := CASE WHEN v_t ~ '^[0-9]+$'
                       THEN coalesce(nullif(pg_catalog.ltrim(v_t, '0'), ''), '0')
                       ELSE v_t END;
        v_idx := pg_catalog.array_position(v_names, v_r);
        IF v_idx IS NULL THEN
            v_names := v_names || v_r;
            v_raws := v_raws || v_t;
            v_norms := v_norms || v_norm;
        ELSIF v_raws[v_idx] IS NULL THEN
            v_raws[v_idx] := v_t;
            v_norms[v_idx] := v_norm;
        ELSIF v_t IS NOT NULL AND v_norm IS DISTINCT FROM v_norms[v_idx] THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FN003',
                MESSAGE = pg_catalog.format(
                    'conflicting fencing tokens %s and %s for resource "%s" in one transaction',
                    pg_catalog.translate(pg_catalog.left(v_raws[v_idx], 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??'), pg_catalog.translate(pg_catalog.left(v_t, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??'),
                    pg_catalog.translate(pg_catalog.left(v_r, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??')),
                DETAIL = 'This transaction was rolled back.',
                HINT = 'A transaction belongs to one leader: use one token per resource.';
        END IF;
    END LOOP;

    -- The session's own resource is fenced even when no comment named it.
    IF v_r0 IS NOT NULL AND pg_catalog.array_position(v_names, v_r0) IS NULL THEN
        v_names := v_names || v_r0;
        v_raws := v_raws || v_t_s;
        v_norms := v_norms || NULL::text;
    ELSIF v_r0 IS NULL AND pg_catalog.array_length(v_names, 1) IS NULL AND v_t_s IS NOT NULL THEN
        -- A session token with nowhere to apply would silently leave the writes unfenced.
        RAISE EXCEPTION USING
            ERRCODE = 'FN003',
            MESSAGE = pg_catalog.format(
                'fencing token %s has no resource: set fencing.resource or add fencing_resource to the comment',
                pg_catalog.translate(pg_catalog.left(v_t_s, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??')),
            DETAIL = 'This transaction was rolled back.',
            HINT = 'Fencing tokens are integers from 0 to 9223372036854775807; resources are 1 to 63 characters from [A-Za-z0-9_.:-].';
    END IF;

    -- 2. Validate everything, in sorted order, before taking any lock.
    FOR v_r, v_t IN
        SELECT u.r, u.t FROM unnest(v_names, v_raws) AS u(r, t)
        ORDER BY u.r COLLATE "C"
    LOOP
        IF v_r !~ '^[A-Za-z0-9_.:-]{1,63}$' THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FN003',
                MESSAGE = pg_catalog.format(
                    'invalid fencing resource "%s": expected 1 to 63 characters from [A-Za-z0-9_.:-]',
                    pg_catalog.translate(pg_catalog.left(v_r, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??')),
                DETAIL = 'This transaction was rolled back.',
                HINT = 'Fencing tokens are integers from 0 to 9223372036854775807; resources are 1 to 63 characters from [A-Za-z0-9_.:-].';
        END IF;
        IF v_t IS NULL THEN
            CONTINUE WHEN v_r = ANY (p_allow_missing) OR '*' = ANY (p_allow_missing);
            RAISE EXCEPTION USING
                ERRCODE = 'FN002',
                MESSAGE = pg_catalog.format(
                    'missing fencing token for resource "%s": the transaction wrote without a token',
                    v_r),
                DETAIL = pg_catalog.format(
                    'Resource "%s" requires a fencing token on every write transaction. This transaction was rolled back.',
                    v_r),
                HINT = 'Set fencing.token (options=-c fencing.token=N, or SET fencing.token = N), or add /* fencing_token=N */ to a statement of the transaction.';
        END IF;
        v_norm := coalesce(nullif(pg_catalog.ltrim(v_t, '0'), ''), '0');
        IF v_t !~ '^[0-9]+$' OR pg_catalog.length(v_norm) > 19
           OR (pg_catalog.length(v_norm) = 19 AND v_norm COLLATE "C" > '9223372036854775807') THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FN003',
                MESSAGE = pg_catalog.format(
                    'invalid fencing token "%s" for resource "%s": expected an integer from 0 to 9223372036854775807',
                    pg_catalog.translate(pg_catalog.left(v_t, 64), pg_catalog.chr(34) || pg_catalog.chr(92), '??'), v_r),
                DETAIL = 'This transaction was rolled back.',
                HINT = 'Fencing tokens are integers from 0 to 9223372036854775807; resources are 1 to 63 characters from [A-Za-z0-9_.:-].';
        END IF;
        v_sorted := v_sorted || v_r;
        v_tokens := v_tokens || v_norm::bigint;
    END LOOP;

    -- 3. Compare with the fences, in sorted order, under the locks described above.
    FOR i IN 1 .. coalesce(pg_catalog.array_length(v_sorted, 1), 0) LOOP
        v_r := v_sorted[i];
        v_token := v_tokens[i];

        SELECT f.token INTO v_seen FROM pgfence.fences AS f WHERE f.resource = v_r;
        v_found := FOUND;
        IF NOT v_found THEN
            INSERT INTO pgfence.fences AS f (resource, token, updated_at)
            VALUES (v_r, v_token, pg_catalog.clock_timestamp())
            ON CONFLICT (resource) DO NOTHING;
            IF FOUND THEN
                -- We created the fence: the uncommitted row makes racing inserters wait.
                INSERT INTO pgfence.history (resource, previous_token, new_token, advanced_at, client_addr)
                VALUES (v_r, NULL, v_token, pg_catalog.clock_timestamp(), v_client);
                v_accepted := v_accepted || (v_r || '=' || v_token::text);
                CONTINUE;
            END IF;
            -- Lost the race (READ COMMITTED only: under REPEATABLE READ the ON CONFLICT
            -- against a row invisible to our snapshot raised 40001). The winner committed.
            SELECT f.token INTO v_seen FROM pgfence.fences AS f WHERE f.resource = v_r;
            v_found := FOUND;
        END IF;
        IF NOT v_found THEN
            -- Only possible if someone deleted a fence row behind pgfence's back.
            RAISE EXCEPTION 'pgfence: the fence row of resource "%" changed concurrently', v_r
                USING ERRCODE = '40001';
        END IF;

        IF v_token > v_seen THEN
            -- Waits for every accept lock: advisory (READ COMMITTED) and row (other levels).
            PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(v_r, 31638886877651813));
            SELECT f.token INTO v_locked FROM pgfence.fences AS f
            WHERE f.resource = v_r FOR NO KEY UPDATE;
            IF v_locked > v_token THEN
                PERFORM pgfence.raise_stale(v_r, v_token, v_locked);
            ELSIF v_locked < v_token THEN
                UPDATE pgfence.fences AS f SET token = v_token, updated_at = pg_catalog.clock_timestamp()
                WHERE f.resource = v_r;
                INSERT INTO pgfence.history (resource, previous_token, new_token, advanced_at, client_addr)
                VALUES (v_r, v_locked, v_token, pg_catalog.clock_timestamp(), v_client);
            END IF;
        ELSIF v_adv THEN
            PERFORM pg_catalog.pg_advisory_xact_lock_shared(pg_catalog.hashtextextended(v_r, 31638886877651813));
            SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource = v_r;
        ELSE
            SELECT f.token INTO v_locked FROM pgfence.fences AS f
            WHERE f.resource = v_r FOR SHARE;
        END IF;
        IF v_token <= v_seen THEN
            IF v_locked > v_token THEN
                PERFORM pgfence.raise_stale(v_r, v_token, v_locked);
            ELSIF v_locked < v_token THEN
                -- Fences never decrease, so this cannot happen; refuse rather than upgrade.
                RAISE EXCEPTION 'pgfence: the fence of resource "%" moved backwards', v_r
                    USING ERRCODE = '40001';
            END IF;
        END IF;
        v_accepted := v_accepted || (v_r || '=' || v_token::text);
    END LOOP;

    IF pg_catalog.array_length(v_accepted, 1) IS NULL THEN
        RETURN NULL;
    END IF;
    IF pg_catalog.array_length(v_accepted, 1) = 1
       AND pg_catalog.current_setting('pgfence.accepted', true) IS DISTINCT FROM v_accepted[1] THEN
        -- One resource accepted (under its lock): the hint for pgfence.check's hot paths,
        -- as the fast path above records it (undone with the transaction if it rolls back).
        PERFORM pg_catalog.set_config('pgfence.accepted', v_accepted[1], false);
    END IF;
    RETURN pg_catalog.array_to_string(v_accepted, ',');
END
$check$;

-- The entry point the proxy calls at every commit, with the hot path of a fenced session.
-- Neither SECURITY DEFINER nor SET search_path (together they cost about a tenth of a
-- fenced check): every name is schema-qualified, every operator spelled
-- OPERATOR(pg_catalog.x) and every type pg_catalog's, so a client's search_path cannot
-- change what it calls. pgfence.check_write (SECURITY DEFINER) holds all writing and every
-- other locking path.
--
-- The hot path: no comment directives, READ COMMITTED accept locks
-- (schema_version.accept_lock = 'advisory'), and this backend accepted this very
-- resource=token before (the `pgfence.accepted` hint, set by check_write). A client can
-- forge the hint, so it only chooses the lock: acceptance needs the fence read under the
-- shared advisory lock to equal the token, compared as text; anything else (a forged
-- hint, a stale or newer token, leading zeros) falls through to check_write, which takes
-- the same shared lock again (a no-op) or rejects. It only reads pgfence.fences, which the
-- grantee may read, and takes the advisory lock: nothing here needs the owner's rights.
-- An empty fencing.resource never matches a hint (check_write records non-empty resources
-- only), so it falls through to check_write's handling of the default resource.
-- Written as few PL/pgSQL expressions as possible, and the hot paths (and the unfenced
-- session's early NULL) before the general path's tests: PL/pgSQL compiles each expression it
-- evaluates again in every transaction, and PERFORM (unlike an IF condition) starts the
-- executor (docs/fence-locking.md, schema version 6). (Not a LANGUAGE sql function: inlining one into the proxy's simple-query
-- rewrite re-parses its body on every call, which costs more than the call it saves.)
CREATE OR REPLACE FUNCTION pgfence.check(
    p_resources      text[],
    p_tokens         text[],
    p_default_resource text,
    p_allow_missing  text[],
    p_client         text,
    p_force          boolean)
RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $entry$
DECLARE
    v_r0     pg_catalog.text;   -- the session's effective resource
    v_t_s    pg_catalog.text;   -- fencing.token of the session, as set
    v_locked pg_catalog.int8;   -- the fence, read under the shared advisory lock
    v_force  pg_catalog.bool := coalesce(p_force, false);
BEGIN
    v_t_s := pg_catalog.current_setting('fencing.token', true);
    IF p_resources IS NULL AND p_tokens IS NULL THEN
        -- No comment directives (the proxy binds NULL arrays then).
        IF v_t_s IS NULL THEN
            IF p_default_resource IS NULL
               AND pg_catalog.current_setting('fencing.resource', true) IS NULL THEN
                -- An unfenced session: no resource and no token anywhere.
                RETURN NULL;
            END IF;
        ELSE
            -- The session's own token.
            v_r0 := coalesce(pg_catalog.current_setting('fencing.resource', true), p_default_resource);
            IF __PGFENCE_ACCEPT_ADVISORY__
               AND pg_catalog.current_setting('pgfence.accepted', true)
                   OPERATOR(pg_catalog.=) (v_r0 OPERATOR(pg_catalog.||) '=' OPERATOR(pg_catalog.||) v_t_s)
               AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed'
               AND (coalesce(p_force, false) OR pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL) THEN
                -- (An IF, not PERFORM: PERFORM runs the executor, an IF condition does not.)
                IF pg_catalog.pg_advisory_xact_lock_shared(
                       pg_catalog.hashtextextended(v_r0, 31638886877651813)) IS NULL THEN
                    RETURN NULL;  -- never: the function returns void, not NULL
                END IF;
                SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource OPERATOR(pg_catalog.=) v_r0;
                IF v_locked::pg_catalog.text OPERATOR(pg_catalog.=) v_t_s THEN
                    RETURN v_r0 OPERATOR(pg_catalog.||) '=' OPERATOR(pg_catalog.||) v_t_s;
                END IF;
            END IF;
        END IF;
    ELSIF __PGFENCE_ACCEPT_ADVISORY__
          AND pg_catalog.cardinality(p_resources) OPERATOR(pg_catalog.=) 1
          AND pg_catalog.cardinality(p_tokens) OPERATOR(pg_catalog.=) 1 THEN
        -- The same for one comment directive (a client that comments its statements alike:
        -- the proxy sends equal directives once) whose resource, named or the session's, is
        -- the only one to check. A comment token overrides the session token for its
        -- resource; a comment without a resource applies to the session's.
        v_r0 := coalesce(pg_catalog.current_setting('fencing.resource', true), p_default_resource);
        IF (p_resources[1] IS NULL OR v_r0 IS NULL OR v_r0 OPERATOR(pg_catalog.=) p_resources[1])
           AND pg_catalog.current_setting('pgfence.accepted', true)
               OPERATOR(pg_catalog.=) (coalesce(p_resources[1], v_r0) OPERATOR(pg_catalog.||) '='
                                       OPERATOR(pg_catalog.||) p_tokens[1])
           AND pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=) 'read committed'
           AND (coalesce(p_force, false) OR pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL) THEN
            v_r0 := coalesce(p_resources[1], v_r0);
            IF pg_catalog.pg_advisory_xact_lock_shared(
                   pg_catalog.hashtextextended(v_r0, 31638886877651813)) IS NULL THEN
                RETURN NULL;  -- never
            END IF;
            SELECT f.token INTO v_locked FROM pgfence.fences AS f WHERE f.resource OPERATOR(pg_catalog.=) v_r0;
            IF v_locked::pg_catalog.text OPERATOR(pg_catalog.=) p_tokens[1] THEN
                RETURN v_r0 OPERATOR(pg_catalog.||) '=' OPERATOR(pg_catalog.||) p_tokens[1];
            END IF;
        END IF;
    END IF;
    -- Everything else, in full.
    IF NOT v_force AND pg_catalog.pg_current_xact_id_if_assigned() IS NULL THEN
        -- Nothing written yet. But a cursor declared WITH HOLD in this transaction runs the
        -- rest of its query when the transaction commits, after this check (PostgreSQL
        -- persists holdable portals at commit): what it may write then is checked now, as
        -- written. A holdable cursor of an earlier transaction was persisted at its end, and
        -- was created before this transaction began (its creation_time is its statement's
        -- start), unless both came in one Query message: then this one is checked too.
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_cursors AS c
                       WHERE c.is_holdable
                         AND c.creation_time OPERATOR(pg_catalog.>=) pg_catalog.now()) THEN
            -- Nothing written, and nothing to be: nothing to fence.
            RETURN NULL;
        END IF;
        v_force := true;
    END IF;
    IF p_default_resource IS NULL
       AND coalesce(pg_catalog.cardinality(p_resources), 0) OPERATOR(pg_catalog.=) 0
       AND coalesce(pg_catalog.cardinality(p_tokens), 0) OPERATOR(pg_catalog.=) 0
       AND coalesce(pg_catalog.length(pg_catalog.current_setting('fencing.resource', true)), 0)
           OPERATOR(pg_catalog.=) 0
       AND coalesce(pg_catalog.length(v_t_s), 0) OPERATOR(pg_catalog.=) 0 THEN
        -- An unfenced session (a setting RESET to '' included).
        RETURN NULL;
    END IF;
    RETURN pgfence.check_write(p_resources, p_tokens, p_default_resource, p_allow_missing,
                               p_client, v_force);
END
$entry$;

COMMENT ON FUNCTION pgfence.check_write(text[], text[], text, text[], text, boolean) IS
    'pgfence: the locking fence check behind pgfence.check (SECURITY DEFINER).';

COMMENT ON FUNCTION pgfence.check(text[], text[], text, text[], text, boolean) IS
    'Checks the fencing tokens of the calling transaction right before it commits; returns the accepted resource=token pairs.';


-- The proxy's fast path sends this instead of a statement known to be stale, so the server
-- transaction fails exactly as the client is told. It never accepts anything.
CREATE OR REPLACE FUNCTION pgfence.fast_reject(p_resource text, p_token bigint, p_known_fence bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $fast$
DECLARE
    v_fence bigint;
BEGIN
    SELECT f.token INTO v_fence FROM pgfence.fences AS f WHERE f.resource = p_resource;
    PERFORM pgfence.raise_stale(p_resource, p_token, greatest(p_known_fence, v_fence));
    -- raise_stale always raises; make sure of it anyway.
    RAISE EXCEPTION 'pgfence: fast_reject did not reject' USING ERRCODE = 'FN001';
END
$fast$;

COMMENT ON FUNCTION pgfence.fast_reject(text, bigint, bigint) IS
    'Always raises FN001: used by the proxy fast path for statements known to carry a stale token.';

-- Whether a read may write (README, "Reads that write through the schema"). The proxy skips
-- the check of a transaction whose statements its classifier reads as reads, which holds
-- only while the schema gives no such statement a way to run a function of the database's
-- own. pgfence.read_audit_objects() lists the objects that do; the proxy asks
-- pgfence.reads_may_write(9) when a client session starts, and checks every transaction of
-- that session when it says true.

-- Objects through which a statement the classifier takes for a read may call a function
-- that is not a built-in (nor an extension's, nor pgfence's own), or a built-in that
-- writes (large objects, transaction ids, the *_to_xml functions that run a query).
-- p_classifier: the schema version whose classifier the asking proxy has (the proxy asks
-- pgfence.reads_may_write(9); older ones pgfence.reads_may_write()). From version 9
-- the classifier takes field selection (`(1).f`, `$1.f`) and a qualified name next to a
-- function in FROM (`g.f` with `generate_series(1, 2) AS g`) for calls, so attribute
-- notation can reach only functions that take a relation's whole row; before it, any
-- function of one argument.
CREATE OR REPLACE FUNCTION pgfence.read_audit_objects(p_classifier integer)
RETURNS SETOF text
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $objects$
BEGIN
-- PL/pgSQL rather than SQL: the plan is kept for the session (planning it takes longer than
-- running it), so the event trigger pays it once per session that runs DDL.
RETURN QUERY
WITH RECURSIVE writing_builtin AS (
    -- Built-ins that write, or run a query given as text.
    SELECT p.oid, p.prosrc FROM pg_catalog.pg_proc AS p
    WHERE p.oid < 16384
      AND p.proname IN ('lo_creat', 'lo_create', 'lo_import', 'lo_unlink', 'lo_put',
                        'lo_from_bytea', 'lo_truncate', 'lo_truncate64', 'lowrite',
                        'txid_current', 'pg_current_xact_id', 'query_to_xml',
                        'query_to_xmlschema', 'query_to_xml_and_xmlschema', 'ts_stat',
                        'ts_rewrite', 'pg_logical_emit_message',
                        'pg_import_system_collations', 'pg_replication_origin_create',
                        'pg_replication_origin_drop', 'nextval', 'setval')
), user_fn AS (
    -- Functions of the database's own: created after initdb (whatever their schema), not
    -- pgfence's, not an extension's, and not an internal-language function that runs a
    -- built-in that does not write (a range type's constructors).
    SELECT p.oid FROM pg_catalog.pg_proc AS p
    WHERE p.oid >= 16384
      AND NOT (p.pronamespace = 'pgfence'::regnamespace
               AND p.proname IN ('check', 'check_write', 'fast_reject', 'raise_stale',
                                 'guard_fences', 'guard_history', 'read_audit_objects',
                                 'reads_may_write', 'audit_reads_on_ddl'))
      AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend AS e
                      WHERE e.classid = 'pg_catalog.pg_proc'::regclass AND e.objid = p.oid
                        AND e.deptype = 'e')
      AND NOT (p.prolang = (SELECT l.oid FROM pg_catalog.pg_language AS l
                            WHERE l.lanname = 'internal')
               AND p.prosrc NOT IN (SELECT w.prosrc FROM writing_builtin AS w))
), called AS (
    SELECT oid FROM user_fn UNION ALL SELECT oid FROM writing_builtin
), calls AS (
    SELECT d.classid, d.objid FROM pg_catalog.pg_depend AS d
    WHERE d.refclassid = 'pg_catalog.pg_proc'::regclass AND d.refobjid IN (SELECT oid FROM user_fn)
), builtin_call AS (
    -- pg_depend records no dependency on a built-in: the expression trees show the calls.
    SELECT ':(funcid|opfuncid|aggfnoid|winfnoid) (' || pg_catalog.string_agg(oid::text, '|')
           || ')\M' AS pattern
    FROM writing_builtin
), one_arg AS (
    -- Functions of one required argument: attribute notation calls them (see the end).
    SELECT p.oid, p.proname, p.proargtypes[0] AS arg, p.provariadic
    FROM pg_catalog.pg_proc AS p
    WHERE p.oid IN (SELECT oid FROM user_fn)
      AND p.pronargs >= 1 AND p.pronargs - p.pronargdefaults <= 1
      AND p.prokind IN ('f', 'a', 'w')
), coercion(source, target) AS (
    -- A value of type source is passed as target without a word in the text: a domain
    -- over it, or an implicit cast (CREATE CAST ... AS IMPLICIT).
    SELECT d.typbasetype, d.oid FROM pg_catalog.pg_type AS d WHERE d.typtype = 'd'
    UNION ALL
    SELECT c.castsource, c.casttarget FROM pg_catalog.pg_cast AS c WHERE c.castcontext = 'i'
), arg_source(arg, source) AS (
    -- The types each one_arg function's argument (or variadic element) takes, walking the
    -- coercions back: few functions, few steps (a scan over all types took 190 ms).
    SELECT a.arg, a.arg FROM one_arg AS a
    UNION
    SELECT a.provariadic, a.provariadic FROM one_arg AS a WHERE a.provariadic <> 0
    UNION
    SELECT s.arg, c.source FROM arg_source AS s JOIN coercion AS c ON c.target = s.source
), row_arg AS (
    -- Argument types a relation's whole row is passed as (t.f is f(t)): those that take a
    -- composite type, record, or any type (the polymorphic ones that take a row).
    SELECT s.arg AS oid FROM arg_source AS s JOIN pg_catalog.pg_type AS t ON t.oid = s.source
    WHERE t.typtype = 'c'
       OR t.oid IN ('pg_catalog.record'::pg_catalog.regtype, 'pg_catalog."any"'::pg_catalog.regtype,
                    'pg_catalog.anyelement'::pg_catalog.regtype,
                    'pg_catalog.anynonarray'::pg_catalog.regtype,
                    'pg_catalog.anycompatible'::pg_catalog.regtype,
                    'pg_catalog.anycompatiblenonarray'::pg_catalog.regtype)
), temp_rel AS (
    -- Temporary relations: only their own session reads through them.
    SELECT k.oid FROM pg_catalog.pg_class AS k WHERE k.relpersistence = 't'
), user_rule AS MATERIALIZED (
    -- Not the system views' rules: turning their trees into text takes tens of milliseconds.
    -- Views only: reading a materialized view runs nothing.
    SELECT r.oid, r.ev_class, r.ev_action
    FROM pg_catalog.pg_rewrite AS r JOIN pg_catalog.pg_class AS v ON v.oid = r.ev_class
    WHERE r.oid >= 16384 AND v.relkind = 'v' AND v.relpersistence <> 't'
)
SELECT 'view ' || r.ev_class::regclass::text
  FROM user_rule AS r
  WHERE r.oid IN (SELECT objid FROM calls WHERE classid = 'pg_catalog.pg_rewrite'::regclass)
     OR r.ev_action::text ~ (SELECT pattern FROM builtin_call)
UNION
SELECT 'row-level security policy ' || pg_catalog.quote_ident(pol.polname) || ' on '
       || pol.polrelid::regclass::text
  FROM pg_catalog.pg_policy AS pol
  WHERE pol.polrelid NOT IN (SELECT oid FROM temp_rel)
    AND (pol.oid IN (SELECT objid FROM calls WHERE classid = 'pg_catalog.pg_policy'::regclass)
     OR pol.polqual::text ~ (SELECT pattern FROM builtin_call)
     OR pol.polwithcheck::text ~ (SELECT pattern FROM builtin_call))
UNION
-- A domain's check runs for casts; a table's CHECK constraints, index expressions,
-- partition keys and statistics expressions are simplified by the planner, which runs the
-- IMMUTABLE functions they call.
SELECT CASE WHEN c.contypid <> 0 THEN 'domain ' || c.contypid::regtype::text
            ELSE 'constraint ' || pg_catalog.quote_ident(c.conname) || ' on '
                 || c.conrelid::regclass::text END
  FROM pg_catalog.pg_constraint AS c
  WHERE c.conrelid NOT IN (SELECT oid FROM temp_rel)
    AND (c.oid IN (SELECT objid FROM calls WHERE classid = 'pg_catalog.pg_constraint'::regclass)
         OR c.conbin::text ~ (SELECT pattern FROM builtin_call))
UNION
SELECT CASE k.relkind WHEN 'i' THEN 'index ' WHEN 'I' THEN 'index ' ELSE 'table ' END
       || k.oid::regclass::text
  FROM pg_catalog.pg_class AS k
  WHERE k.oid IN (SELECT objid FROM calls WHERE classid = 'pg_catalog.pg_class'::regclass)
    AND k.relpersistence <> 't'
UNION
SELECT 'statistics ' || s.stxname
  FROM pg_catalog.pg_statistic_ext AS s
  WHERE s.stxrelid NOT IN (SELECT oid FROM temp_rel)
    AND s.oid IN (SELECT objid FROM calls WHERE classid = 'pg_catalog.pg_statistic_ext'::regclass)
UNION
SELECT 'operator ' || o.oid::regoperator::text
  FROM pg_catalog.pg_operator AS o
  WHERE o.oprcode::oid IN (SELECT oid FROM called)
     OR o.oprrest::oid IN (SELECT oid FROM called)
     OR o.oprjoin::oid IN (SELECT oid FROM called)
UNION
SELECT 'cast ' || pg_catalog.format_type(c.castsource, NULL) || ' AS '
       || pg_catalog.format_type(c.casttarget, NULL)
  FROM pg_catalog.pg_cast AS c WHERE c.castfunc IN (SELECT oid FROM called)
UNION
SELECT 'aggregate ' || a.aggfnoid::regprocedure::text
  FROM pg_catalog.pg_aggregate AS a
  WHERE a.aggfnoid::oid IN (SELECT oid FROM user_fn)
     OR a.aggtransfn::oid IN (SELECT oid FROM called)
     OR a.aggfinalfn::oid IN (SELECT oid FROM called)
     OR a.aggcombinefn::oid IN (SELECT oid FROM called)
     OR a.aggserialfn::oid IN (SELECT oid FROM called)
     OR a.aggdeserialfn::oid IN (SELECT oid FROM called)
     OR a.aggmtransfn::oid IN (SELECT oid FROM called)
     OR a.aggminvtransfn::oid IN (SELECT oid FROM called)
     OR a.aggmfinalfn::oid IN (SELECT oid FROM called)
UNION
SELECT 'operator family ' || f.opfname || ' support function ' || ap.amproc::regprocedure::text
  FROM pg_catalog.pg_amproc AS ap JOIN pg_catalog.pg_opfamily AS f ON f.oid = ap.amprocfamily
  WHERE ap.amproc::oid IN (SELECT oid FROM called)
UNION
SELECT 'type ' || t.oid::regtype::text
  FROM pg_catalog.pg_type AS t
  WHERE t.typinput::oid IN (SELECT oid FROM called) OR t.typoutput::oid IN (SELECT oid FROM called)
     OR t.typreceive::oid IN (SELECT oid FROM called) OR t.typsend::oid IN (SELECT oid FROM called)
     OR t.typmodin::oid IN (SELECT oid FROM called) OR t.typmodout::oid IN (SELECT oid FROM called)
     OR t.typanalyze::oid IN (SELECT oid FROM called)
     OR t.typsubscript::oid IN (SELECT oid FROM called)
UNION
SELECT 'range type ' || r.rngtypid::regtype::text
  FROM pg_catalog.pg_range AS r
  WHERE r.rngcanonical::oid IN (SELECT oid FROM called)
     OR r.rngsubdiff::oid IN (SELECT oid FROM called)
UNION
SELECT 'conversion ' || c.conname
  FROM pg_catalog.pg_conversion AS c WHERE c.conproc::oid IN (SELECT oid FROM called)
UNION
SELECT 'text search parser ' || p.prsname
  FROM pg_catalog.pg_ts_parser AS p
  WHERE p.prsstart::oid IN (SELECT oid FROM called) OR p.prstoken::oid IN (SELECT oid FROM called)
     OR p.prsend::oid IN (SELECT oid FROM called) OR p.prsheadline::oid IN (SELECT oid FROM called)
     OR p.prslextype::oid IN (SELECT oid FROM called)
UNION
SELECT 'text search template ' || t.tmplname
  FROM pg_catalog.pg_ts_template AS t
  WHERE t.tmplinit::oid IN (SELECT oid FROM called) OR t.tmpllexize::oid IN (SELECT oid FROM called)
UNION
SELECT 'access method ' || am.amname
  FROM pg_catalog.pg_am AS am WHERE am.amhandler::oid IN (SELECT oid FROM called)
UNION
SELECT 'foreign-data wrapper ' || w.fdwname
  FROM pg_catalog.pg_foreign_data_wrapper AS w WHERE w.fdwhandler IN (SELECT oid FROM called)
UNION
SELECT 'function ' || p.oid::regprocedure::text || ' (a built-in''s name)'
  FROM pg_catalog.pg_proc AS p
  WHERE p.oid IN (SELECT oid FROM user_fn)
    AND EXISTS (SELECT 1 FROM pg_catalog.pg_proc AS b WHERE b.proname = p.proname AND b.oid < 16384)
UNION
-- Names that are infix keywords after an operand (a LIKE (b), t JOIN (u ...)): the
-- classifier takes some calls of them for grammar (fence_core::classify::INFIX_KEYWORDS).
SELECT 'function ' || p.oid::regprocedure::text || ' (a name the classifier may take for a keyword)'
  FROM pg_catalog.pg_proc AS p
  WHERE p.oid IN (SELECT oid FROM user_fn)
    AND p.proname IN ('like', 'ilike', 'overlaps', 'join')
UNION
-- Attribute notation calls a function of one argument: t.f is f(t), for a relation t whose
-- whole row the function takes (the classifier cannot tell it from a column), and (1).f is
-- f(1) whatever the type (the classifier takes that for a call from version 9).
SELECT 'function ' || a.oid::regprocedure::text || ' (callable as an attribute, x.'
       || pg_catalog.quote_ident(a.proname) || ')'
  FROM one_arg AS a
  WHERE p_classifier < 9 OR a.arg IN (SELECT oid FROM row_arg)
     OR a.provariadic IN (SELECT oid FROM row_arg)
ORDER BY 1;
END
$objects$;

COMMENT ON FUNCTION pgfence.read_audit_objects(integer) IS
    'pgfence: objects through which a statement the proxy takes for a read may call a function of this database''s own, for a proxy whose classifier is of the given schema version.';

CREATE OR REPLACE FUNCTION pgfence.read_audit_objects()
RETURNS SETOF text
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $objects$
    SELECT * FROM pgfence.read_audit_objects(9)
$objects$;

COMMENT ON FUNCTION pgfence.read_audit_objects() IS
    'pgfence: objects through which a statement the proxy takes for a read may call a function of this database''s own.';

-- The verdict, kept by the event trigger below at the end of every command that may change
-- it, so that a session start reads a row rather than auditing the catalog (a few
-- milliseconds): reads may write while the table has a row. Each DDL transaction that
-- finds a way in adds a row of its own, which no concurrent transaction can see or remove
-- before it commits; one that finds none removes the rows it sees, in the statement that
-- audits (one snapshot for both), skipping rows another transaction holds. So the trigger
-- never waits for a lock, and cannot make DDL deadlock or fail with 40001
-- (docs/fence-locking.md, "The read audit").
CREATE TABLE IF NOT EXISTS pgfence.read_audit (
    xact      xid8        NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    raised_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

DELETE FROM pgfence.read_audit;
INSERT INTO pgfence.read_audit (xact, raised_at)
SELECT pg_catalog.pg_current_xact_id(), pg_catalog.now()
WHERE EXISTS (SELECT 1 FROM pgfence.read_audit_objects(9));

-- Runs as the owner (the DDL's user may not write pgfence's tables).
CREATE OR REPLACE FUNCTION pgfence.audit_reads_on_ddl()
RETURNS event_trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $audit$
BEGIN
    IF pg_catalog.to_regclass('pgfence.read_audit') IS NULL
       OR pg_catalog.to_regprocedure('pgfence.read_audit_objects(integer)') IS NULL THEN
        RETURN;
    END IF;
    -- Temporary tables and their indexes: applications create them often, and they give
    -- no other session's read a way in.
    IF TG_TAG IN ('CREATE TABLE', 'ALTER TABLE', 'CREATE INDEX', 'ALTER INDEX',
                  'CREATE STATISTICS', 'ALTER STATISTICS')
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger_ddl_commands() AS c
                       WHERE c.schema_name IS DISTINCT FROM 'pg_temp') THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM pgfence.read_audit_objects(9)) THEN
        IF pg_catalog.current_setting('transaction_isolation') = 'serializable' THEN
            -- A blind insert: reading the table too would make two such transactions a
            -- serialization failure (40001) for one of them.
            INSERT INTO pgfence.read_audit DEFAULT VALUES;
        ELSIF NOT EXISTS (SELECT 1 FROM pgfence.read_audit AS a
                          WHERE a.xact = pg_catalog.pg_current_xact_id()) THEN
            INSERT INTO pgfence.read_audit DEFAULT VALUES;
        END IF;
        IF pg_catalog.current_setting('transaction_isolation') = 'read committed' THEN
            -- Older rows are not needed while this one stands (if this transaction rolls
            -- back, so does the removal).
            DELETE FROM pgfence.read_audit AS a
            WHERE a.xact <> pg_catalog.pg_current_xact_id()
              AND a.ctid IN (SELECT b.ctid FROM pgfence.read_audit AS b FOR UPDATE SKIP LOCKED);
        END IF;
    ELSIF pg_catalog.current_setting('transaction_isolation') = 'read committed' THEN
        -- Under the other levels a row committed after the snapshot would make the removal
        -- fail with 40001: the verdict stays true until a later command lowers it.
        DELETE FROM pgfence.read_audit AS a
        WHERE a.ctid IN (SELECT b.ctid FROM pgfence.read_audit AS b FOR UPDATE SKIP LOCKED)
          AND NOT EXISTS (SELECT 1 FROM pgfence.read_audit_objects(9));
    END IF;
END
$audit$;

-- Creating an event trigger takes a superuser. Without it pgfence.reads_may_write() audits
-- the catalog at every call (correct, a few milliseconds per session start); `pgfence
-- install` says so.
DO $trigger$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = current_user AND rolsuper) THEN
        RETURN;
    END IF;
    -- Created again, so that an upgrade brings its list of commands up to date.
    DROP EVENT TRIGGER IF EXISTS pgfence_read_audit;
    CREATE EVENT TRIGGER pgfence_read_audit ON ddl_command_end
        WHEN TAG IN (
            'CREATE ACCESS METHOD', 'DROP ACCESS METHOD',
            'CREATE AGGREGATE', 'ALTER AGGREGATE', 'DROP AGGREGATE',
            'CREATE CAST', 'DROP CAST',
            'CREATE CONVERSION', 'ALTER CONVERSION', 'DROP CONVERSION',
            'CREATE DOMAIN', 'ALTER DOMAIN', 'DROP DOMAIN',
            'CREATE EXTENSION', 'ALTER EXTENSION', 'DROP EXTENSION',
            'CREATE FOREIGN DATA WRAPPER', 'ALTER FOREIGN DATA WRAPPER',
            'DROP FOREIGN DATA WRAPPER',
            'CREATE FUNCTION', 'ALTER FUNCTION', 'DROP FUNCTION',
            'CREATE PROCEDURE', 'ALTER PROCEDURE', 'DROP PROCEDURE',
            'ALTER ROUTINE', 'DROP ROUTINE',
            'CREATE OPERATOR', 'ALTER OPERATOR', 'DROP OPERATOR',
            'CREATE OPERATOR CLASS', 'ALTER OPERATOR CLASS', 'DROP OPERATOR CLASS',
            'CREATE OPERATOR FAMILY', 'ALTER OPERATOR FAMILY', 'DROP OPERATOR FAMILY',
            'CREATE POLICY', 'ALTER POLICY', 'DROP POLICY',
            'CREATE RULE', 'ALTER RULE', 'DROP RULE',
            'CREATE SCHEMA', 'ALTER SCHEMA', 'DROP SCHEMA',
            'CREATE TEXT SEARCH PARSER', 'ALTER TEXT SEARCH PARSER',
            'DROP TEXT SEARCH PARSER',
            'CREATE TEXT SEARCH TEMPLATE', 'ALTER TEXT SEARCH TEMPLATE',
            'DROP TEXT SEARCH TEMPLATE',
            'CREATE TYPE', 'ALTER TYPE', 'DROP TYPE',
            'CREATE VIEW', 'ALTER VIEW', 'DROP VIEW',
            'CREATE TABLE', 'ALTER TABLE', 'CREATE INDEX', 'ALTER INDEX',
            'CREATE STATISTICS', 'ALTER STATISTICS', 'CREATE FOREIGN TABLE',
            'ALTER FOREIGN TABLE', 'IMPORT FOREIGN SCHEMA', 'DROP OWNED')
        EXECUTE FUNCTION pgfence.audit_reads_on_ddl();
END
$trigger$;

-- What the proxy asks when a client session starts: the kept verdict while the event trigger
-- keeps it, else a fresh audit. A lock on the table (VACUUM FULL, LOCK TABLE) makes it fail
-- after a second rather than hold the client's login; the proxy then checks that session's
-- reads. p_classifier: the schema version whose classifier the asking proxy has (see
-- read_audit_objects); the kept verdict is for version 9's, so an older one's question is
-- audited afresh where the verdict is false.
CREATE OR REPLACE FUNCTION pgfence.reads_may_write(p_classifier integer)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '1s'
AS $reads$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger AS t
               WHERE t.evtname = 'pgfence_read_audit' AND t.evtenabled IN ('O', 'A')
                 AND t.evtfoid = pg_catalog.to_regprocedure('pgfence.audit_reads_on_ddl()')) THEN
        IF EXISTS (SELECT 1 FROM pgfence.read_audit) THEN
            RETURN true;
        ELSIF p_classifier >= 9 THEN
            RETURN false;
        END IF;
    END IF;
    RETURN EXISTS (SELECT 1 FROM pgfence.read_audit_objects(p_classifier));
END
$reads$;

COMMENT ON FUNCTION pgfence.reads_may_write(integer) IS
    'pgfence: whether a statement a proxy with the classifier of the given schema version takes for a read may call a function of this database''s own (the proxy then checks reads too).';

-- What proxies before schema version 9 ask: the answer for their classifier.
CREATE OR REPLACE FUNCTION pgfence.reads_may_write()
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $reads$
    SELECT pgfence.reads_may_write(8)
$reads$;

COMMENT ON FUNCTION pgfence.reads_may_write() IS
    'pgfence: whether a statement the proxy takes for a read may call a function of this database''s own (the proxy then checks reads too).';

-- Privileges: nobody but the owner writes; the grantee reads and calls the two entry points.
REVOKE ALL ON SCHEMA pgfence FROM PUBLIC;
REVOKE ALL ON TABLE pgfence.fences, pgfence.history, pgfence.schema_version, pgfence.read_audit
    FROM PUBLIC;
REVOKE ALL ON SEQUENCE pgfence.history_id_seq FROM PUBLIC;
REVOKE ALL ON FUNCTION pgfence.check(text[], text[], text, text[], text, boolean),
    pgfence.check_write(text[], text[], text, text[], text, boolean),
                       pgfence.fast_reject(text, bigint, bigint),
                       pgfence.raise_stale(text, bigint, bigint),
                       pgfence.guard_fences(),
                       pgfence.guard_history(),
                       pgfence.audit_reads_on_ddl(),
                       pgfence.reads_may_write(),
                       pgfence.reads_may_write(integer),
                       pgfence.read_audit_objects(integer),
                       pgfence.read_audit_objects()
    FROM PUBLIC;

GRANT USAGE ON SCHEMA pgfence TO __PGFENCE_GRANTEE__;
GRANT EXECUTE ON FUNCTION pgfence.check(text[], text[], text, text[], text, boolean),
    pgfence.check_write(text[], text[], text, text[], text, boolean),
                          pgfence.fast_reject(text, bigint, bigint),
                          pgfence.reads_may_write(),
                          pgfence.reads_may_write(integer),
                          pgfence.read_audit_objects(integer),
                          pgfence.read_audit_objects()
    TO __PGFENCE_GRANTEE__;
GRANT SELECT ON TABLE pgfence.fences, pgfence.history, pgfence.schema_version,
    pgfence.read_audit
    TO __PGFENCE_GRANTEE__;

COMMIT;
