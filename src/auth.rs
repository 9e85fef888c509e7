//! Bearer authentication, permissions and queue scope (spec: http-api.md §1).
//!
//! Tokens are stored only as a SHA-256 digest; a token never appears in a
//! log line, an error message or a URL.

use actix_web::HttpRequest;
use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use rand::RngExt;

use crate::{
    domain::{
        ApplicationId, CredentialId, NamespaceId, Permission, PermissionSet, QueueId, sha256_hex,
    },
    error::{Error, Result},
    store::{Database, tenancy},
};

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
    /// 403 `PERMISSION_DENIED` unless the credential holds `permission`.
    pub fn require(&self, permission: Permission) -> Result<()> {
        if self.permissions.contains(permission) {
            Ok(())
        } else {
            Err(Error::permission_denied(format!(
                "the credential lacks the {} permission",
                permission.as_str()
            )))
        }
    }

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

/// Authenticates the request's `Authorization: Bearer` header: missing,
/// malformed, unknown or revoked → 401 `UNAUTHENTICATED`.
pub async fn authenticate(req: &HttpRequest, db: &Database) -> Result<Principal> {
    let mut headers = req
        .headers()
        .get_all(actix_web::http::header::AUTHORIZATION);
    let header = headers
        .next()
        .ok_or_else(|| Error::unauthenticated("missing Authorization: Bearer header"))?;
    // Two credentials in one request: neither is trusted (the first
    // winning would let a proxy's header be overridden, or the reverse).
    if headers.next().is_some() {
        return Err(Error::unauthenticated(
            "more than one Authorization header; send exactly one",
        ));
    }
    let value = header
        .to_str()
        .map_err(|_| Error::unauthenticated("malformed Authorization header"))?;
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let token = value
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|t| !t.is_empty() && !t.contains(' '))
        .ok_or_else(|| Error::unauthenticated("malformed Authorization header; expected Bearer"))?;
    authenticate_token(token, db).await
}

/// Resolves a bearer token to its principal (401 when unknown or revoked).
pub async fn authenticate_token(token: &str, db: &Database) -> Result<Principal> {
    tenancy::principal_by_token_digest(db.reader(), &token_digest(token))
        .await?
        .ok_or_else(|| Error::unauthenticated("unknown or revoked credential"))
}
