//! In-process inbox store (being written).
