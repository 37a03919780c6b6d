//! The suite proves it can fail: every deliberately broken store is
//! rejected, by the contract tests and by the crash-point model on its own,
//! in per-message and in batched mode.

mod common;

use inbox_conformance::broken::{Broken, BrokenHarness};
use inbox_conformance::model::Mode;
use inbox_conformance::{contract, ledger, model, outbox, response, runtime};

/// Cases the model gets to find each bug (with a fixed seed, so the test is
/// stable); the healthy store passes the same schedules.
const MODEL_CASES: u32 = 300;

#[test]
fn contract_tests_reject_every_broken_store() {
    let rt = runtime();
    for kind in Broken::ALL
        .into_iter()
        .chain(Broken::FINGERPRINTS)
        .chain(Broken::BATCH)
    {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        let failures = rt.block_on(contract::run_all(&harness));
        assert!(
            !failures.is_empty(),
            "the contract tests accepted a store broken by {kind:?}"
        );
        let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
        println!("{kind:?} rejected by {names:?}");
    }
}

/// A store that forgets fingerprints still deduplicates: only the
/// scenario about copies with another payload catches it.
#[test]
fn only_the_conflict_scenario_catches_forgotten_fingerprints() {
    let rt = runtime();
    let harness = BrokenHarness::new(common::MemoryHarness, Broken::ForgetsFingerprints);
    let failures = rt.block_on(contract::run_all(&harness));
    let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["a_copy_with_another_payload_is_a_conflict"]);
}

fn model_rejects_every_broken_store(mode: Mode) {
    let rt = runtime();
    for kind in Broken::ALL.into_iter().chain(Broken::FINGERPRINTS) {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        match model::run_deterministic(&rt, &harness, MODEL_CASES, mode) {
            Ok(()) => panic!("the {mode:?} crash-point model accepted a store broken by {kind:?}"),
            Err(failure) => println!("{kind:?} rejected by the {mode:?} model:\n{failure}\n"),
        }
    }
}

#[test]
fn crash_point_model_rejects_every_broken_store() {
    model_rejects_every_broken_store(Mode::PerMessage);
}

#[test]
fn batched_crash_point_model_rejects_every_broken_store() {
    model_rejects_every_broken_store(Mode::Batched);
}

/// A batch claim whose answer does not line up with its keys is caught by
/// the batched model too, not only by the contract test that reads the
/// claims directly.
#[test]
fn batched_crash_point_model_rejects_a_batch_claim_that_miscounts() {
    let rt = runtime();
    for kind in Broken::BATCH {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        match model::run_deterministic(&rt, &harness, MODEL_CASES, Mode::Batched) {
            Ok(()) => panic!("the batched crash-point model accepted a store broken by {kind:?}"),
            Err(failure) => println!("{kind:?} rejected by the batched model:\n{failure}\n"),
        }
    }
}

#[test]
fn outbox_contract_tests_reject_every_broken_outbox() {
    let rt = runtime();
    for kind in Broken::OUTBOX {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        let failures = rt.block_on(outbox::contract::run_all(&harness));
        assert!(
            !failures.is_empty(),
            "the outbox contract tests accepted a store broken by {kind:?}"
        );
        let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
        println!("{kind:?} rejected by {names:?}");
    }
}

#[test]
fn outbox_model_rejects_every_broken_outbox() {
    let rt = runtime();
    for kind in Broken::OUTBOX {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        match outbox::model::run_deterministic(&rt, &harness, MODEL_CASES) {
            Ok(()) => panic!("the outbox crash-point model accepted a store broken by {kind:?}"),
            Err(failure) => println!("{kind:?} rejected by the outbox model:\n{failure}\n"),
        }
    }
}

/// An outbox bug is not an inbox bug: the inbox suite still passes over
/// the broken outboxes, so the rejections above are the outbox suite's.
#[test]
fn the_inbox_suite_passes_over_a_broken_outbox() {
    let rt = runtime();
    for kind in Broken::OUTBOX {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        let failures = rt.block_on(contract::run_all(&harness));
        assert!(failures.is_empty(), "{kind:?}: {failures:?}");
    }
}

#[test]
fn ledger_contract_tests_reject_every_broken_ledger() {
    let rt = runtime();
    for kind in Broken::LEDGER {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        let failures = rt.block_on(ledger::run_all(&harness));
        assert!(
            !failures.is_empty(),
            "the ledger contract tests accepted a store broken by {kind:?}"
        );
        let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
        println!("{kind:?} rejected by {names:?}");
        // A ledger bug is not an inbox bug.
        let inbox_failures = rt.block_on(contract::run_all(&harness));
        assert!(inbox_failures.is_empty(), "{kind:?}: {inbox_failures:?}");
    }
}

#[test]
fn response_contract_tests_reject_every_broken_store() {
    let rt = runtime();
    for kind in Broken::RESPONSES {
        let harness = BrokenHarness::new(common::MemoryHarness, kind);
        let failures = rt.block_on(response::run_all(&harness));
        assert!(
            !failures.is_empty(),
            "the kept-response tests accepted a store broken by {kind:?}"
        );
        let names: Vec<_> = failures.iter().map(|(name, _)| *name).collect();
        println!("{kind:?} rejected by {names:?}");
    }
}

#[test]
fn healthy_store_passes_what_rejects_the_broken_ones() {
    let rt = runtime();
    let failures = rt.block_on(contract::run_all(&common::MemoryHarness));
    assert!(
        failures.is_empty(),
        "healthy memory store failed: {failures:?}"
    );
    for mode in [Mode::PerMessage, Mode::Batched] {
        model::run_deterministic(&rt, &common::MemoryHarness, MODEL_CASES, mode)
            .unwrap_or_else(|failure| panic!("{failure}"));
    }
    let failures = rt.block_on(outbox::contract::run_all(&common::MemoryHarness));
    assert!(
        failures.is_empty(),
        "healthy memory outbox failed: {failures:?}"
    );
    outbox::model::run_deterministic(&rt, &common::MemoryHarness, MODEL_CASES)
        .unwrap_or_else(|failure| panic!("{failure}"));
    let failures = rt.block_on(ledger::run_all(&common::MemoryHarness));
    assert!(
        failures.is_empty(),
        "healthy memory ledger failed: {failures:?}"
    );
    let failures = rt.block_on(response::run_all(&common::MemoryHarness));
    assert!(
        failures.is_empty(),
        "healthy memory store failed the kept-response tests: {failures:?}"
    );
}
