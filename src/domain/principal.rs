//! The authenticated caller and its tokens: what a credential may do and
//! where (spec: http-api.md §1). Tokens are stored only as a SHA-256
//! digest; a token never appears in a log line, an error message or a URL.

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use rand::RngExt;

use super::{ApplicationId, CredentialId, NamespaceId, PermissionSet, QueueId, sha256_hex};

/// Prefix of every token, so a leaked token is recognizable by scanners.
pub const TOKEN_PREFIX: &str = "oe_";

/// The authenticated caller: everything a request may not carry itself
/// (namespace, application, credential) comes from here.
#[derive(Debug, Clone)]
pub struct Principal {
    pub credential_id: CredentialId,
    pub namespace_id: NamespaceId,
    pub application_id: ApplicationId,
    pub permissions: PermissionSet,
    pub queue_scope: Vec<QueueId>,
}

impl Principal {
    /// Whether `queue` is in the credential's queue scope.
    pub fn in_scope(&self, queue: &QueueId) -> bool {
        self.queue_scope.contains(queue)
    }
}

/// A fresh token: `oe_` + 43 characters of base64url (256 random bits).
pub fn generate_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    format!("{TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes))
}

/// The stored form of a token.
pub fn token_digest(token: &str) -> String {
    sha256_hex(token.as_bytes())
}

/// `text` with every token-shaped run (`oe_` and the base64url characters
/// after it) replaced by `oe_***`: for log lines that carry a client's text
/// (a path, a close reason), where a token pasted by mistake must not land.
pub fn mask_tokens(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains(TOKEN_PREFIX) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(TOKEN_PREFIX) {
        out.push_str(&rest[..at]);
        out.push_str(TOKEN_PREFIX);
        out.push_str("***");
        let after = &rest[at + TOKEN_PREFIX.len()..];
        let end = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .unwrap_or(after.len());
        rest = &after[end..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod mask_tests {
    use super::*;

    #[test]
    fn every_token_shaped_run_is_masked_wherever_it_stands() {
        let token = generate_token();
        assert_eq!(
            mask_tokens(&format!("/v1/x{token}/y?{token}")),
            "/v1/xoe_***/y?oe_***"
        );
        assert_eq!(
            mask_tokens(&format!("unknown client frame type \"{token}\"")),
            "unknown client frame type \"oe_***\""
        );
        assert_eq!(mask_tokens("/v1/queues"), "/v1/queues");
    }
}
