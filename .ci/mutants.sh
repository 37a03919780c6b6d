#!/usr/bin/env bash
# Mutation testing: how many mutants of each library crate its suites catch.
#
# Not part of .ci/run: a full run takes hours on two cores (README,
# "Mutation testing"). Each crate is mutated alone and tested by the suites
# that are its own: inbox-api and the memory backend by the offline suite
# (their tests and inbox-conformance's, on the memory backend), the
# Postgres crates by their PostgreSQL suites, the runtime by its tests
# (the broker-bound ones need RabbitMQ). Exclusions, each with its reason:
# .cargo/mutants.toml.
#
#   bash .ci/mutants.sh                                  every library crate
#   MUTANTS_CRATES="inbox-api" bash .ci/mutants.sh       some crates
#   MUTANTS_FILE=inbox-api/src/inbox.rs bash .ci/mutants.sh   one file
#   MUTANTS_RE='claim_each' bash .ci/mutants.sh          mutants by name
#   MUTANTS_SHARD=0/4 bash .ci/mutants.sh                a quarter of them
#   MUTANTS_LIST=1 bash .ci/mutants.sh                   count, run nothing
#
# Prints caught / missed / timeout / unviable and the caught share of the
# viable mutants per crate; the lists are under target/mutants/<crate>/.
set -euo pipefail
cd "$(dirname "$0")/.."

version=27.1.0
if ! cargo mutants --version 2>/dev/null | grep -q "$version"; then
    echo "mutants: installing cargo-mutants $version"
    cargo install --locked cargo-mutants --version "$version"
fi

crates=${MUTANTS_CRATES:-"inbox-api inbox-backend-memory inbox-postgres inbox-backend-sqlx inbox-backend-diesel inbox-runtime"}

# The suites that test a crate.
tests_of() {
    case $1 in
        inbox-api | inbox-backend-memory) echo "inbox-api inbox-backend-memory inbox-conformance" ;;
        inbox-postgres) echo "inbox-postgres inbox-backend-sqlx inbox-backend-diesel" ;;
        *) echo "$1" ;;
    esac
}

if [ -z "${MUTANTS_LIST:-}" ]; then
    # inbox-conformance's shared ledger and the Postgres and runtime suites
    # need the services; the offline part needs none, but one command.
    bash .ci/services.sh
fi

# The longest test run of one mutant, in seconds: cargo-mutants would set
# it from its baseline, which runs the mutated crate's own tests only, far
# shorter than the suites named above (the PostgreSQL suites take 10 to 15
# minutes). A hang past it counts as a timeout, which the table shows.
timeout_of() {
    case $1 in
        inbox-api | inbox-backend-memory) echo 300 ;;
        inbox-runtime) echo 1200 ;;
        *) echo 2400 ;;
    esac
}

# A test run per mutant: a small model, the offline suite's speed.
export PROPTEST_CASES=${PROPTEST_CASES:-32}

summary=()
for crate in $crates; do
    args=(--package "$crate" --all-features --no-shuffle --timeout "$(timeout_of "$crate")")
    for t in $(tests_of "$crate"); do
        args+=(--test-package "$t")
    done
    [ -n "${MUTANTS_FILE:-}" ] && args+=(--file "$MUTANTS_FILE")
    [ -n "${MUTANTS_RE:-}" ] && args+=(--re "$MUTANTS_RE")
    [ -n "${MUTANTS_SHARD:-}" ] && args+=(--shard "$MUTANTS_SHARD")
    if [ -n "${MUTANTS_LIST:-}" ]; then
        n=$(cargo mutants "${args[@]}" --list | wc -l)
        summary+=("$crate: $n mutants")
        continue
    fi
    out="target/mutants/$crate"
    mkdir -p "$out"
    started=$(date +%s)
    # cargo-mutants exits non-zero when a mutant survives: the table says it.
    cargo mutants "${args[@]}" --output "$out" || true
    count() { [ -f "$out/mutants.out/$1.txt" ] && wc -l < "$out/mutants.out/$1.txt" || echo 0; }
    caught=$(count caught) missed=$(count missed) timeout=$(count timeout) unviable=$(count unviable)
    viable=$((caught + missed + timeout))
    percent=$(python3 -c "print(f'{100 * $caught / $viable:.1f}' if $viable else '-')")
    summary+=("$crate: caught $caught, missed $missed, timeout $timeout, unviable $unviable: $percent % of viable ($(( $(date +%s) - started )) s)")
    if [ "$missed" -gt 0 ]; then
        sed 's/^/    missed: /' "$out/mutants.out/missed.txt"
    fi
done

echo "== mutation testing"
printf '%s\n' "${summary[@]}"
