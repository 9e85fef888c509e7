//! Bearer authentication, permissions and queue scope (spec: http-api.md §1).
//!
//! Tokens are stored only as a SHA-256 digest; a token never appears in a
//! log line, an error message or a URL.

use actix_web::{HttpMessage, HttpRequest};

use crate::{
    domain::Permission,
    error::{Error, Result},
    store::{Database, tenancy},
};

pub use crate::domain::{Principal, TOKEN_PREFIX, generate_token, token_digest};

/// `require` on a [`Principal`], answered with the edge error.
pub trait Require {
    /// 403 `PERMISSION_DENIED` unless the credential holds `permission`.
    fn require(&self, permission: Permission) -> Result<()>;
}

impl Require for Principal {
    fn require(&self, permission: Permission) -> Result<()> {
        if self.permissions.contains(permission) {
            Ok(())
        } else {
            Err(Error::permission_denied(format!(
                "the credential lacks the {} permission",
                permission.as_str()
            )))
        }
    }
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
    let principal = authenticate_token(token, db).await?;
    // For the access log line (`http::access_log`).
    req.extensions_mut().insert(principal.credential_id.clone());
    Ok(principal)
}

/// Resolves a bearer token to its principal (401 when unknown or revoked).
pub async fn authenticate_token(token: &str, db: &Database) -> Result<Principal> {
    tenancy::principal_by_token_digest(db, &token_digest(token))
        .await?
        .ok_or_else(|| Error::unauthenticated("unknown or revoked credential"))
}
