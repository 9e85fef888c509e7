//! List cursors (spec: http-api.md §3 "List cursors").
//!
//! A cursor is `base64url(payload) "." base64url(HMAC-SHA256)`; the payload
//! carries only the last `(created_at, id)` of a page. The MAC covers the
//! payload *and* the binding (endpoint, namespace, credential, parent id,
//! `state` filter), which therefore never travels in the cursor: a cursor
//! presented with any other binding, or altered in any byte, fails
//! verification and the request answers 400 `INVALID_ARGUMENT`.
//!
//! The key lives in `signing_keys` (purpose `list-cursor`) so that every
//! node accepts every other node's cursors. It is created on first use by
//! an `INSERT .. ON CONFLICT (purpose) DO NOTHING` followed by a read: two
//! nodes creating it at once both end up with the one row that won.

use crate::store::StoreError;
use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use entity::signing_key;
use hmac::{Hmac, KeyInit, Mac};
use rand::RngExt;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, Set, sea_query::OnConflict};
use sha2::Sha256;

use crate::{
    domain::{is_id, now, random_hex_id},
    store::Database,
};

/// `signing_keys.purpose` of the list-cursor key.
const PURPOSE: &str = "list-cursor";
/// Version tag of the payload format, also mixed into the MAC.
const VERSION: &str = "v1";
/// Cursors longer than this are refused before any decoding.
pub const MAX_CURSOR_LEN: usize = 256;

/// The list-cursor signing key (32 random bytes).
#[derive(Clone)]
pub struct CursorKey(Vec<u8>);

impl std::fmt::Debug for CursorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CursorKey(..)")
    }
}

/// What a cursor is bound to: it is valid only for the same list endpoint,
/// caller and filter that issued it.
#[derive(Debug, Clone, Copy)]
pub struct CursorBinding<'a> {
    /// `subscriptions` or `deliveries`.
    pub endpoint: &'static str,
    pub namespace_id: &'a str,
    pub credential_id: &'a str,
    /// The queue id (subscription list) or subscription id (delivery list).
    pub parent_id: &'a str,
    /// The `state` filter of the delivery list, if any.
    pub state: Option<&'a str>,
}

/// The last row of a page in list order (`created_at DESC, id DESC`); the
/// next page starts strictly after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPosition {
    /// Microseconds since the Unix epoch.
    pub created_at: i64,
    pub id: String,
}

/// The key if one exists (a cursor cannot be valid before the first one
/// was issued, so readers never create it).
pub async fn load_key<C: ConnectionTrait>(conn: &C) -> Result<Option<CursorKey>, StoreError> {
    let row = signing_key::Entity::find()
        .filter(signing_key::Column::Purpose.eq(PURPOSE))
        .one(conn)
        .await?;
    Ok(row.and_then(|r| URL_SAFE_NO_PAD.decode(r.secret).ok().map(CursorKey)))
}

/// The key, created on first use (safe when several nodes race: the unique
/// `purpose` keeps one row and every node reads that one).
pub async fn ensure_key(db: &Database) -> Result<CursorKey, StoreError> {
    if let Some(key) = load_key(db.reader()).await? {
        return Ok(key);
    }
    let secret: [u8; 32] = rand::rng().random();
    let key = db
        .write_alone(async |txn| {
            signing_key::Entity::insert(signing_key::ActiveModel {
                id: Set(random_hex_id()),
                purpose: Set(PURPOSE.to_owned()),
                secret: Set(URL_SAFE_NO_PAD.encode(secret)),
                created_at: Set(now().micros()),
            })
            .on_conflict(
                OnConflict::column(signing_key::Column::Purpose)
                    .do_nothing()
                    .to_owned(),
            )
            .exec_without_returning(txn)
            .await?;
            load_key(txn).await
        })
        .await?;
    key.ok_or_else(|| StoreError::invariant("the list-cursor key could not be read back"))
}

/// `None` only if the key were refused, which HMAC never does.
fn mac(key: &CursorKey, binding: &CursorBinding<'_>, payload: &str) -> Option<Hmac<Sha256>> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&key.0).ok()?;
    for part in [
        VERSION,
        binding.endpoint,
        binding.namespace_id,
        binding.credential_id,
        binding.parent_id,
        binding.state.unwrap_or("-"),
        payload,
    ] {
        // Length-prefixed so that no two bindings share a MAC input.
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part.as_bytes());
    }
    Some(mac)
}

/// The cursor that resumes a list after `last`.
pub fn encode(key: &CursorKey, binding: &CursorBinding<'_>, last: &ListPosition) -> Option<String> {
    let payload = format!("{VERSION}:{}:{}", last.created_at, last.id);
    let tag = mac(key, binding, &payload)?.finalize().into_bytes();
    Some(format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(payload.as_bytes()),
        URL_SAFE_NO_PAD.encode(tag)
    ))
}

/// True when `cursor` has the outer shape of a cursor (checked before
/// authentication, with the other query-string rules).
pub fn well_formed(cursor: &str) -> bool {
    !cursor.is_empty()
        && cursor.len() <= MAX_CURSOR_LEN
        && cursor
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The position in `cursor` if it was issued with this key and binding;
/// `None` for anything altered, foreign or malformed.
pub fn decode(key: &CursorKey, binding: &CursorBinding<'_>, cursor: &str) -> Option<ListPosition> {
    if !well_formed(cursor) {
        return None;
    }
    let (payload_b64, tag_b64) = cursor.split_once('.')?;
    let payload = String::from_utf8(URL_SAFE_NO_PAD.decode(payload_b64).ok()?).ok()?;
    let tag = URL_SAFE_NO_PAD.decode(tag_b64).ok()?;
    // Constant-time comparison.
    mac(key, binding, &payload)?.verify_slice(&tag).ok()?;
    let mut parts = payload.splitn(3, ':');
    if parts.next()? != VERSION {
        return None;
    }
    let created_at = parts.next()?.parse::<i64>().ok()?;
    let id = parts.next()?;
    is_id(id).then(|| ListPosition {
        created_at,
        id: id.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding<'a>(parent: &'a str, state: Option<&'a str>) -> CursorBinding<'a> {
        CursorBinding {
            endpoint: "deliveries",
            namespace_id: "n",
            credential_id: "c",
            parent_id: parent,
            state,
        }
    }

    #[test]
    fn a_cursor_decodes_only_with_its_own_key_and_binding() {
        let key = CursorKey(vec![7; 32]);
        let last = ListPosition {
            created_at: 1_700_000_000_000_000,
            id: "0123456789abcdef0123456789abcdef".to_owned(),
        };
        let c = encode(&key, &binding("p", Some("ACKED")), &last).unwrap();
        assert!(well_formed(&c));
        assert_eq!(decode(&key, &binding("p", Some("ACKED")), &c), Some(last));
        assert_eq!(decode(&key, &binding("p", None), &c), None);
        assert_eq!(decode(&key, &binding("q", Some("ACKED")), &c), None);
        assert_eq!(
            decode(&CursorKey(vec![8; 32]), &binding("p", Some("ACKED")), &c),
            None
        );
        // Every single-character alteration is refused.
        for i in 0..c.len() {
            let mut bytes = c.clone().into_bytes();
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let altered = String::from_utf8(bytes).unwrap();
            if altered != c {
                assert_eq!(
                    decode(&key, &binding("p", Some("ACKED")), &altered),
                    None,
                    "{altered}"
                );
            }
        }
    }
}
