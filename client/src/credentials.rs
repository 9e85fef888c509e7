//! The bearer token and idempotency keys (spec: http-api.md §1–2).

use std::fmt;

use rand::RngExt;

/// A credential's bearer token. It never appears in `Debug` output, in an
/// error message or in a URL.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// Checks the token's shape (1–4096 visible ASCII characters, as an
    /// `Authorization` header can carry it); the service decides whether
    /// it is valid.
    pub fn new(token: impl Into<String>) -> Result<Token, crate::Error> {
        let token = token.into();
        let token = token.trim().to_owned();
        if token.is_empty() || token.len() > 4096 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(crate::Error::InvalidInput(
                "the token must be 1-4096 visible ASCII characters (as printed by \
                 `orbit-events bootstrap`)"
                    .to_owned(),
            ));
        }
        Ok(Token(token))
    }

    /// Reads the token from the environment variable `name`.
    pub fn from_env(name: &str) -> Result<Token, crate::Error> {
        match std::env::var(name) {
            Ok(value) => Token::new(value).map_err(|_| {
                crate::Error::InvalidInput(format!(
                    "{name} does not hold a token (1-4096 visible ASCII characters)"
                ))
            }),
            Err(_) => Err(crate::Error::InvalidInput(format!(
                "{name} is not set: export the token printed by `orbit-events bootstrap`, \
                 e.g. `export {name}=oe_...`"
            ))),
        }
    }

    pub(crate) fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// An `Idempotency-Key`: 1–255 visible ASCII characters, scoped to the
/// credential. Resending a write with the same key and the same request
/// returns the original answer with `deduplicated: true`; the same key
/// with a different request is `IDEMPOTENCY_CONFLICT`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A caller-chosen key (derive it from what makes the write unique in
    /// your system, so that a retry after a crash reuses it).
    pub fn new(key: impl Into<String>) -> Result<IdempotencyKey, crate::Error> {
        let key = key.into();
        if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(crate::Error::InvalidInput(
                "an idempotency key is 1-255 visible ASCII characters".to_owned(),
            ));
        }
        Ok(IdempotencyKey(key))
    }

    /// A fresh random key (32 hex characters). Keep it to retry the same
    /// write.
    pub fn random() -> IdempotencyKey {
        IdempotencyKey(random_hex())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// 128 random bits as 32 lowercase hex characters (message ids, keys).
pub(crate) fn random_hex() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_never_shows_in_debug_output() {
        let token = Token::new("oe_secret").unwrap();
        assert!(!format!("{token:?}").contains("secret"));
        assert!(Token::new("has space").is_err());
        assert!(Token::new("").is_err());
    }

    #[test]
    fn idempotency_keys_are_1_to_255_visible_ascii_characters() {
        assert!(IdempotencyKey::new("k").is_ok());
        assert!(IdempotencyKey::new("k".repeat(255)).is_ok());
        for bad in [
            "".to_owned(),
            "k".repeat(256),
            "a b".to_owned(),
            "é".to_owned(),
        ] {
            assert!(IdempotencyKey::new(bad.clone()).is_err(), "{bad:?}");
        }
        let random = IdempotencyKey::random();
        assert_eq!(random.as_str().len(), 32);
        assert_ne!(random, IdempotencyKey::random());
    }
}
