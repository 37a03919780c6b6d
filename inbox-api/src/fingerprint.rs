//! What a message said, in 32 bytes: [`Fingerprint`].

use std::fmt;

use sha2::{Digest, Sha256};

use crate::InboxError;

/// The SHA-256 of a message's payload, kept in the inbox row beside its key.
///
/// A key says which message; the fingerprint says what it said. A second
/// delivery under a processed key is normally a redelivery of the same
/// bytes, and is dropped. One whose fingerprint differs is a producer that
/// reused an id for another message (a bug, or a replay with edited
/// content): [`crate::Handled::Conflict`] tells the consumer so instead of
/// dropping it without a word. Fixed-size, so the row stays small whatever
/// the payload; SHA-256 so that two payloads with one fingerprint do not
/// happen by accident.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The length in bytes.
    pub const LEN: usize = 32;

    /// The fingerprint of `payload` (the delivery's body, say, or whatever
    /// bytes the consumer treats as the message's content).
    pub fn of(payload: &[u8]) -> Self {
        Self(Sha256::digest(payload).into())
    }

    /// A fingerprint as a store keeps it.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when `bytes` is not [`Self::LEN`]
    /// long: a column that holds something else is not ours.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, InboxError> {
        <[u8; 32]>::try_from(bytes)
            .map(Self)
            .map_err(|_| InboxError::InvalidArgument {
                message: format!(
                    "a payload fingerprint is {} bytes, not {}",
                    Self::LEN,
                    bytes.len()
                ),
            })
    }

    /// The 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// Lowercase hex, as `sha256sum` prints it.
impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fingerprint_is_the_payloads_sha256_in_hex() {
        // `printf abc | sha256sum`
        assert_eq!(
            Fingerprint::of(b"abc").to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_ne!(Fingerprint::of(b"abc"), Fingerprint::of(b"abd"));
    }

    /// What a log line or a `{:?}` of `Handled::Conflict` shows: the
    /// fingerprint itself, comparable with `sha256sum`'s output.
    #[test]
    fn debug_shows_the_hex() {
        let print = Fingerprint::of(b"abc");
        assert_eq!(format!("{print:?}"), format!("Fingerprint({print})"));
        assert!(format!("{print:?}").contains("ba7816bf"));
    }

    #[test]
    fn only_32_bytes_read_back_as_a_fingerprint() {
        let print = Fingerprint::of(b"x");
        assert_eq!(Fingerprint::from_bytes(print.as_bytes()).unwrap(), print);
        for bad in [&[][..], &[0; 31][..], &[0; 33][..]] {
            assert!(matches!(
                Fingerprint::from_bytes(bad),
                Err(InboxError::InvalidArgument { .. })
            ));
        }
    }
}
