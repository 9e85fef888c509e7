//! Lease secrets and their digests (spec: delivery-model.md §6).
//!
//! A secret is 32 random bytes, sent once as base64url without padding (43
//! characters); only its SHA-256 digest is stored, and proofs are compared
//! by digest in constant time.

use std::fmt;

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use rand::RngExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A lease secret. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseSecret([u8; 32]);

/// Why a wire `lease_secret` is not acceptable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease_secret must be 43 characters of canonical base64url without padding")]
pub struct LeaseSecretError;

impl LeaseSecret {
    /// A fresh secret from the thread-local CSPRNG.
    pub fn generate() -> LeaseSecret {
        LeaseSecret(rand::rng().random())
    }

    /// Parses the wire form: exactly 43 characters of canonical base64url
    /// (no padding, unused trailing bits zero).
    pub fn parse(s: &str) -> Result<LeaseSecret, LeaseSecretError> {
        if s.len() != 43 {
            return Err(LeaseSecretError);
        }
        let bytes = URL_SAFE_NO_PAD.decode(s).map_err(|_| LeaseSecretError)?;
        let arr: [u8; 32] = bytes.try_into().map_err(|_| LeaseSecretError)?;
        Ok(LeaseSecret(arr))
    }

    /// The wire form (43 characters).
    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.0)
    }

    /// The stored form: lowercase hex SHA-256 of the raw bytes.
    pub fn digest_hex(&self) -> String {
        sha256_hex(&self.0)
    }

    /// Constant-time comparison of this secret's digest with a stored digest.
    pub fn matches_digest(&self, stored_hex: &str) -> bool {
        let mine = self.digest_hex();
        mine.len() == stored_hex.len() && bool::from(mine.as_bytes().ct_eq(stored_hex.as_bytes()))
    }
}

impl fmt::Debug for LeaseSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseSecret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_form_is_43_canonical_characters() {
        let s = LeaseSecret::generate();
        let wire = s.encode();
        assert_eq!(wire.len(), 43);
        assert_eq!(LeaseSecret::parse(&wire).unwrap(), s);
        assert!(s.matches_digest(&s.digest_hex()));
        assert!(!LeaseSecret::generate().matches_digest(&s.digest_hex()));
    }

    #[test]
    fn non_canonical_forms_are_refused() {
        let zero = "A".repeat(43);
        assert!(LeaseSecret::parse(&zero).is_ok());
        // Last character carries bits that must be zero: 'B' sets one.
        assert!(LeaseSecret::parse(&format!("{}B", "A".repeat(42))).is_err());
        assert!(LeaseSecret::parse(&format!("{zero}=")).is_err());
        assert!(LeaseSecret::parse(&"A".repeat(42)).is_err());
        assert!(LeaseSecret::parse(&format!("{}+", "A".repeat(42))).is_err());
        assert!(format!("{:?}", LeaseSecret::generate()).contains("redacted"));
    }
}
