#!/usr/bin/env bash
# Installs what pgfence's tests, benchmarks and CI need on a Debian machine, and only what is
# missing: the PostgreSQL server and clients (initdb, pg_ctl, psql, pgbench, and the
# `postgres` OS user the test harness runs servers as under root), pgbouncer (for the
# benchmark runner), pip when python3 has none, psycopg 3, asyncpg and SQLAlchemy 2 (with
# greenlet, for its async engine) for the Python driver tests, and Node.js with npm and the Node.js driver tests' packages (`npm ci` in tests/node,
# from its committed package-lock.json).
#
# Idempotent: a machine that has everything is left alone (no apt-get update; `npm ci` only
# when tests/node/node_modules is missing or was installed from another lockfile). Installs
# as root without sudo; as another user it prints what is missing and exits 1, except that
# it runs `npm ci` itself when that is all that is missing (it needs no root).
set -euo pipefail

node_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../tests/node" && pwd)
# A copy of the lockfile `npm ci` installed from, to tell a stale node_modules.
node_stamp=$node_dir/node_modules/.pgfence-package-lock.json

PSYCOPG_SPEC='psycopg[binary]>=3.1'
# asyncpg is 0.x: a minor release may change behaviour, so stay below 1.
ASYNCPG_SPEC='asyncpg>=0.29,<1'
# The asyncio extra brings greenlet, which SQLAlchemy 2.1 no longer installs by itself.
SQLALCHEMY_SPEC='SQLAlchemy[asyncio]>=2.0,<3'

have_pg_server() {
    local bindir
    bindir=$(pg_config --bindir 2>/dev/null || true)
    [[ -n $bindir && -x $bindir/initdb ]] && return 0
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

apt_packages=()
if ! have_pg_server || ! command -v psql >/dev/null || ! command -v pgbench >/dev/null \
    || ! id -u postgres >/dev/null 2>&1; then
    apt_packages+=(postgresql postgresql-client)
fi
if ! command -v pgbouncer >/dev/null && [[ ! -x /usr/sbin/pgbouncer ]]; then
    apt_packages+=(pgbouncer)
fi
if ! command -v python3 >/dev/null; then
    apt_packages+=(python3 python3-pip)
elif ! python3 -m pip --version >/dev/null 2>&1; then
    apt_packages+=(python3-pip)
fi

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_packages+=(nodejs npm)
fi

need_psycopg=false
if ! command -v python3 >/dev/null || ! python3 -c 'import psycopg' >/dev/null 2>&1; then
    need_psycopg=true
fi
need_asyncpg=false
if ! command -v python3 >/dev/null || ! python3 -c 'import asyncpg' >/dev/null 2>&1; then
    need_asyncpg=true
fi

need_sqlalchemy=false
if ! command -v python3 >/dev/null || ! python3 -c 'import sqlalchemy, greenlet' >/dev/null 2>&1; then
    need_sqlalchemy=true
fi
need_node_modules=false
if ! cmp -s "$node_dir/package-lock.json" "$node_stamp"; then
    need_node_modules=true
fi

if [[ ${#apt_packages[@]} -eq 0 && $need_psycopg == false && $need_asyncpg == false \
    && $need_sqlalchemy == false && $need_node_modules == false ]]; then
    echo "install-deps: everything is installed"
    exit 0
fi

if [[ $(id -u) -ne 0 ]] \
    && [[ ${#apt_packages[@]} -gt 0 || $need_psycopg == true || $need_asyncpg == true \
        || $need_sqlalchemy == true ]]; then
    echo "install-deps: missing, and not root:" >&2
    [[ ${#apt_packages[@]} -gt 0 ]] && echo "  sudo apt-get install ${apt_packages[*]}" >&2
    [[ $need_psycopg == true ]] && echo "  python3 -m pip install '$PSYCOPG_SPEC'" >&2
    [[ $need_asyncpg == true ]] && echo "  python3 -m pip install '$ASYNCPG_SPEC'" >&2
    [[ $need_sqlalchemy == true ]] && echo "  python3 -m pip install '$SQLALCHEMY_SPEC'" >&2
    [[ $need_node_modules == true ]] && echo "  (cd $node_dir && npm ci)" >&2
    exit 1
fi

retry() {
    local attempt
    for attempt in 1 2 3; do
        "$@" && return 0
        echo "install-deps: attempt $attempt of '$*' failed" >&2
        sleep $((attempt * 5))
    done
    return 1
}

if [[ ${#apt_packages[@]} -gt 0 ]]; then
    echo "install-deps: apt-get install ${apt_packages[*]}"
    if [[ " ${apt_packages[*]} " == *" postgresql "* ]]; then
        # The tests start their own servers: do not create (and start) a cluster on 5432.
        mkdir -p /etc/postgresql-common/createcluster.d
        echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/pgfence.conf
    fi
    export DEBIAN_FRONTEND=noninteractive
    retry apt-get -o DPkg::Lock::Timeout=300 update -q
    retry apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${apt_packages[@]}"
fi

# pip_install SPEC: installs SPEC with python3's pip, retrying with --break-system-packages
# where the distribution marks its python as externally managed (PEP 668).
pip_install() {
    local spec=$1 out
    if out=$(python3 -m pip install --progress-bar off -q --root-user-action=ignore "$spec" 2>&1); then
        return 0
    fi
    if grep -q externally-managed-environment <<<"$out"; then
        python3 -m pip install --progress-bar off -q --root-user-action=ignore --break-system-packages "$spec"
    else
        echo "$out" >&2
        return 1
    fi
}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ $need_psycopg == true ]]; then
    echo "install-deps: python3 -m pip install '$PSYCOPG_SPEC' ($(command -v python3))"
    retry pip_install "$PSYCOPG_SPEC"
    python3 -c 'import psycopg; print("install-deps: psycopg", psycopg.__version__)'
fi
if [[ $need_asyncpg == true ]]; then
    echo "install-deps: python3 -m pip install '$ASYNCPG_SPEC' ($(command -v python3))"
    retry pip_install "$ASYNCPG_SPEC"
    python3 -c 'import asyncpg; print("install-deps: asyncpg", asyncpg.__version__)'
fi
if [[ $need_sqlalchemy == true ]]; then
    echo "install-deps: python3 -m pip install '$SQLALCHEMY_SPEC' ($(command -v python3))"
    retry pip_install "$SQLALCHEMY_SPEC"
    python3 -c 'import sqlalchemy; print("install-deps: SQLAlchemy", sqlalchemy.__version__)'
fi

# npm_ci: installs exactly the lockfile's packages into tests/node/node_modules (removing
# what was there), then records which lockfile that was.
npm_ci() {
    (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error) \
        && cp "$node_dir/package-lock.json" "$node_stamp"
}
if [[ $need_node_modules == true ]]; then
    echo "install-deps: npm ci in $node_dir (node $(node --version), npm $(npm --version))"
    retry npm_ci
fi
echo "install-deps: done"
