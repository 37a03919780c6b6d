//! Connection URLs without their passwords, for logs: `inbox-api`'s one
//! function, which every crate of the workspace uses.

pub use inbox_api::redact_url;
