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

/// Inserts one audit record inside the caller's transaction.
pub async fn record<C: ConnectionTrait>(
    conn: &C,
    actor: &AuditActor,
    entry: AuditEntry<'_>,
) -> Result<(), StoreError> {
    record_many(conn, vec![(actor, entry)]).await
}

/// Inserts one audit record per entry in one statement, inside the
/// caller's transaction (an ACK batch: one record per ACK).
pub async fn record_many<C: ConnectionTrait>(
    conn: &C,
    entries: Vec<(&AuditActor, AuditEntry<'_>)>,
) -> Result<(), StoreError> {
    if entries.is_empty() {
        return Ok(());
    }
    let models = entries
        .into_iter()
        .map(|(actor, entry)| audit_record::ActiveModel {
            id: Set(ordered_hex_id()),
            namespace_id: Set(actor.namespace_id.as_str().to_owned()),
            credential_id: Set(actor.credential_id.as_str().to_owned()),
            action: Set(entry.action.to_owned()),
            target_id: Set(entry.target_id.to_owned()),
            reason: Set(entry.reason.map(str::to_owned)),
            before_revision: Set(entry.before_revision),
            after_revision: Set(entry.after_revision),
            at: Set(entry.at.micros()),
            created_at: Set(entry.at.micros()),
        });
    Ok(audit_record::Entity::insert_many(models)
        .exec_without_returning(conn)
        .await?)
    .map(|_| ())
}
