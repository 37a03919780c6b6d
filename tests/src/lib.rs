//! The shared conformance suite every `InboxStore` backend runs.
#![deny(missing_docs)]

mod harness;

pub use harness::{CrashKind, Harness, TxOf};
