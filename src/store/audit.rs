//! Audit records: who changed what, and the revision before and after.

use crate::store::StoreError;
use entity::audit_record;
use sea_orm::{ConnectionTrait, EntityTrait, Set};

use crate::domain::{CredentialId, NamespaceId, Timestamp, ordered_hex_id};

/// The acting credential of an audited change.
#[derive(Debug, Clone)]
pub struct AuditActor {
    pub namespace_id: NamespaceId,
    pub credential_id: CredentialId,
}

/// One audited change.
pub struct AuditEntry<'a> {
    pub action: &'static str,
    pub target_id: &'a str,
    pub reason: Option<&'a str>,
    pub before_revision: Option<i64>,
    pub after_revision: Option<i64>,
    pub at: Timestamp,
}

/// Inserts one audit record inside the caller's transaction; returns its
/// id (a delivery's history points at the record of its retry).
pub async fn record<C: ConnectionTrait>(
    conn: &C,
    actor: &AuditActor,
    entry: AuditEntry<'_>,
) -> Result<String, StoreError> {
    let id = ordered_hex_id();
    record_with_id(conn, &id, actor, entry).await?;
    Ok(id)
}

/// [`record`] under an id chosen before (a bulk retry's history rows point
/// at its record before it is written).
pub async fn record_with_id<C: ConnectionTrait>(
    conn: &C,
    id: &str,
    actor: &AuditActor,
    entry: AuditEntry<'_>,
) -> Result<(), StoreError> {
    audit_record::Entity::insert(audit_record::ActiveModel {
        id: Set(id.to_owned()),
        namespace_id: Set(actor.namespace_id.as_str().to_owned()),
        credential_id: Set(actor.credential_id.as_str().to_owned()),
        action: Set(entry.action.to_owned()),
        target_id: Set(entry.target_id.to_owned()),
        reason: Set(entry.reason.map(str::to_owned)),
        before_revision: Set(entry.before_revision),
        after_revision: Set(entry.after_revision),
        at: Set(entry.at.micros()),
        created_at: Set(entry.at.micros()),
    })
    .exec_without_returning(conn)
    .await?;
    Ok(())
}
