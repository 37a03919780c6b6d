//! The whole conformance suite against the memory backend.

mod common;

inbox_conformance::conformance_tests!(common::memory_harness);

inbox_conformance::outbox_conformance_tests!(common::memory_harness);

inbox_conformance::ledger_conformance_tests!(common::memory_harness);

inbox_conformance::response_conformance_tests!(common::memory_harness);
