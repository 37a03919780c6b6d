#!/bin/bash
# The inbox's statements in pgbench, no client library at all: the physical
# ceiling of the benchmark's PostgreSQL ratios on this machine (see
# docs/benchmark-notes.md). Run from this folder:
#
#   psql -h 127.0.0.1 -U postgres -d test -f setup.sql   # schema ratios_pgb
#   ./run.sh off 3 4          # synchronous_commit, repetitions, seconds per cell
#   psql -h 127.0.0.1 -U postgres -d test -c 'DROP SCHEMA ratios_pgb CASCADE'
#
# Cells are interleaved (every script at every client count once per
# repetition), so drift on a shared machine spreads over all of them.
# CLIENTS picks the client counts (default: 1 4 16).
# SCRIPTS picks the scripts (default: all). tps of the batch scripts are
# transactions of 100 messages.
set -euo pipefail
sc=${1:-on}
reps=${2:-3}
secs=${3:-4}
# batch100.sql, what handle_batch sends for K = 100: BEGIN, one claim of
# 100 ids, 100 single-row business INSERTs, COMMIT (written here, not kept).
batch100=$(mktemp --suffix=.sql)
trap 'rm -f "$batch100"' EXIT
{
  echo '\set r random(1, 4000000000000000000)'
  echo 'BEGIN;'
  grep -E '^INSERT INTO inbox_messages' batch100multi.sql
  for _ in $(seq 1 100); do grep -E '^INSERT INTO bench_events' bare.sql; done
  echo 'COMMIT;'
} >"$batch100"
export PGOPTIONS="-c search_path=ratios_pgb -c synchronous_commit=$sc"
for rep in $(seq 1 "$reps"); do
  for c in ${CLIENTS:-1 4 16}; do
    for s in ${SCRIPTS:-bare inbox pipelined guarded batch100 batch100multi}; do
      tps=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -c "$c" -j 2 -T "$secs" -f "$([ "$s" = batch100 ] && echo "$batch100" || echo "$s.sql")" test 2>&1 |
        grep -E "^tps" | grep -oE "[0-9]+\.[0-9]+" | head -1)
      echo "synchronous_commit=$sc rep=$rep clients=$c script=$s tps=$tps load=$(cut -d' ' -f1 /proc/loadavg)"
    done
  done
done
