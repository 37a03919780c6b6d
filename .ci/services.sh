#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432, user postgres, trust auth, database
# `test`), PgBouncer in transaction mode in front of it (127.0.0.1:6432,
# .ci/pgbouncer.ini), RabbitMQ (127.0.0.1:5672, guest/guest) and NATS with
# JetStream (127.0.0.1:4222) are running.
#
# Idempotent and quiet when both are up. On a fresh Debian machine it installs
# them with apt, sets trust auth, and starts them (no systemd needed). Fails
# loudly, naming the service, when one cannot be brought up: tests must never
# silently skip a missing service.
set -euo pipefail

log() { echo "services: $*" >&2; }
die() { echo "services: ERROR: $*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root (or sudo) to run: $*"; fi
}

apt_updated=0
apt_install() {
  command -v apt-get >/dev/null || die "$1 is missing and this is not a Debian-like system: install $* by hand"
  if [ "$apt_updated" -eq 0 ]; then
    log "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  log "installing $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

wait_until() { # seconds, description, command...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq "$seconds"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  die "$what did not become ready within ${seconds}s"
}

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432; }

ensure_postgres() {
  if command -v pg_isready >/dev/null && pg_up; then
    :
  else
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
      apt_install postgresql
    fi
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n1)
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    if ! as_root grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
      log "setting trust auth for local connections in $hba"
      as_root sed -i -E 's/^(local|host)(\s+all\s+all\s+.*)\s(peer|md5|scram-sha-256)$/\1\2 trust/' "$hba"
      as_root sed -i -E 's/^(local\s+all\s+postgres\s+)(peer|md5|scram-sha-256)$/\1trust/' "$hba"
      printf 'local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n' | as_root tee -a "$hba" >/dev/null
    fi
    log "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start \
      || as_root pg_ctlcluster --skip-systemctl-redirect "$version" main restart \
      || die "PostgreSQL $version would not start (see /var/log/postgresql/)"
    wait_until 60 "PostgreSQL on 127.0.0.1:5432" pg_up
  fi
  if ! psql -h 127.0.0.1 -U postgres -d test -Atqc 'select 1' >/dev/null 2>&1; then
    psql -h 127.0.0.1 -U postgres -d postgres -qc 'CREATE DATABASE test' >/dev/null \
      || die "PostgreSQL is up but database 'test' is missing and could not be created (trust auth for user postgres?)"
    log "created database test"
  fi
}

# The AMQP port accepting a connection is the readiness that matters (`ping`
# answers about a second before the port listens).
rabbit_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

ensure_rabbitmq() {
  if rabbit_up; then
    return 0
  fi
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
  log "starting RabbitMQ"
  as_root rabbitmq-server -detached || true
  wait_until 90 "RabbitMQ on 127.0.0.1:5672" rabbit_up
}

# PgBouncer answering its admin console proves the port is PgBouncer's, and
# its pool_mode that it is the transaction-mode one the tests need.
bouncer_mode() {
  PGCONNECT_TIMEOUT=3 psql -h 127.0.0.1 -p 6432 -U postgres -d pgbouncer -Atqc 'SHOW CONFIG' 2>/dev/null \
    | awk -F'|' '$1 == "pool_mode" { print $2 }'
}
port_taken() { (exec 3<>/dev/tcp/127.0.0.1/6432) 2>/dev/null; }

bouncer_ready() { [ "$(bouncer_mode)" = transaction ]; }

ensure_pgbouncer() {
  if bouncer_ready; then
    return 0
  fi
  if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
    apt_install pgbouncer
    # Debian's package starts its own PgBouncer (session mode, port 6432)
    # where an init system runs; ours takes its place.
    as_root systemctl stop pgbouncer >/dev/null 2>&1 || as_root service pgbouncer stop >/dev/null 2>&1 || true
  fi
  if port_taken; then
    die "127.0.0.1:6432 is taken by something that is not PgBouncer in transaction mode (pool_mode '$(bouncer_mode || true)'): stop it, the PgBouncer tests need that port"
  fi
  local bin config
  bin=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
  config="$(pwd)/.ci/pgbouncer.ini"
  log "starting PgBouncer (transaction mode) on 127.0.0.1:6432"
  # PgBouncer refuses to run as root; the postgres user exists wherever
  # PostgreSQL was installed from Debian's packages.
  if [ "$(id -u)" -eq 0 ]; then
    # A copy the postgres user can read, wherever the checkout is.
    install -m 0644 "$config" /tmp/inbox-ci-pgbouncer.ini
    touch /tmp/inbox-ci-pgbouncer.log && chown postgres /tmp/inbox-ci-pgbouncer.log
    su postgres -s /bin/sh -c "$bin -d /tmp/inbox-ci-pgbouncer.ini" >&2 \
      || die "PgBouncer would not start (see /tmp/inbox-ci-pgbouncer.log)"
  else
    "$bin" -d "$config" >&2 || die "PgBouncer would not start (see /tmp/inbox-ci-pgbouncer.log)"
  fi
  wait_until 30 "PgBouncer (transaction mode) on 127.0.0.1:6432" bouncer_ready
}

# A NATS server announces itself with an INFO line; `"jetstream":true` in it
# says JetStream is on, which the NATS tests need (a plain NATS server on
# the port would fail them in obscure ways).
nats_info() { timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222 && head -n 1 <&3' 2>/dev/null; }
nats_up() { nats_info | grep -q '"jetstream":true'; }

ensure_nats() {
  if nats_up; then
    return 0
  fi
  if nats_info | grep -q '^INFO'; then
    die "127.0.0.1:4222 is a NATS server without JetStream: restart it with -js, the NATS tests need JetStream"
  fi
  local bin
  bin=$(command -v nats-server || echo /usr/sbin/nats-server)
  [ -x "$bin" ] || { apt_install nats-server; bin=$(command -v nats-server || echo /usr/sbin/nats-server); }
  log "starting NATS with JetStream on 127.0.0.1:4222"
  as_root mkdir -p /var/lib/nats-server
  # Debian's package starts nothing where no init system runs; the daemon
  # is started the way this machine's own NATS is.
  as_root start-stop-daemon --start --oknodo --background --exec "$bin" -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log \
    || die "nats-server would not start (see /var/log/nats-server.log)"
  wait_until 30 "NATS with JetStream on 127.0.0.1:4222" nats_up
}

ensure_postgres
ensure_pgbouncer
ensure_rabbitmq
ensure_nats
