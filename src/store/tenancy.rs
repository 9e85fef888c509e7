//! Namespaces, applications, queues and credentials: `bootstrap`,
//! authentication lookups, the operator's listing and revocation (spec:
//! architecture.md §5).

use crate::store::StoreError;
use entity::{application, credential, namespace, queue};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, Set,
};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};

use crate::{
    domain::{
        ApplicationId, CredentialId, NamespaceId, Permission, PermissionSet, QueueId, Timestamp,
        now,
    },
    domain::{Principal, generate_token, token_digest},
    store::{Database, sqlite},
};

/// What `orbit-events bootstrap` prints: the token is shown only this once.
#[derive(Debug, Serialize)]
pub struct BootstrapOutput {
    pub namespace_id: String,
    pub application_id: String,
    pub queue_id: String,
    pub credential_id: String,
    pub token: String,
    pub permissions: Vec<&'static str>,
}

/// Creates (or reuses, by name) the namespace, application and queue, and a
/// new credential with `permissions` scoped to that queue, in one transaction.
pub async fn bootstrap(
    db: &Database,
    namespace_name: &str,
    application_name: &str,
    queue_name: &str,
    permissions: &[Permission],
) -> Result<BootstrapOutput, StoreError> {
    db.write_alone(async |txn| {
        let t = now().micros();

        let ns = match namespace::Entity::find()
            .filter(namespace::Column::Name.eq(namespace_name))
            .one(txn)
            .await?
        {
            Some(ns) => ns,
            None => {
                namespace::ActiveModel {
                    id: Set(NamespaceId::generate().into_string()),
                    name: Set(namespace_name.to_owned()),
                    created_at: Set(t),
                }
                .insert(txn)
                .await?
            }
        };
        let app = match application::Entity::find()
            .filter(application::Column::NamespaceId.eq(&ns.id))
            .filter(application::Column::Name.eq(application_name))
            .one(txn)
            .await?
        {
            Some(app) => app,
            None => {
                application::ActiveModel {
                    id: Set(ApplicationId::generate().into_string()),
                    namespace_id: Set(ns.id.clone()),
                    name: Set(application_name.to_owned()),
                    created_at: Set(t),
                }
                .insert(txn)
                .await?
            }
        };
        let q = match queue::Entity::find()
            .filter(queue::Column::NamespaceId.eq(&ns.id))
            .filter(queue::Column::Name.eq(queue_name))
            .one(txn)
            .await?
        {
            Some(q) => q,
            None => {
                queue::ActiveModel {
                    id: Set(QueueId::generate().into_string()),
                    namespace_id: Set(ns.id.clone()),
                    name: Set(queue_name.to_owned()),
                    head_sequence: Set(0),
                    retention_floor: Set(0),
                    created_at: Set(t),
                }
                .insert(txn)
                .await?
            }
        };

        let token = generate_token();
        let perms = PermissionSet::new(permissions.to_vec());
        let names = perms.names();
        let cred = credential::ActiveModel {
            id: Set(CredentialId::generate().into_string()),
            namespace_id: Set(ns.id.clone()),
            application_id: Set(app.id.clone()),
            token_digest: Set(token_digest(&token)),
            permissions: Set(to_json_array(&names)),
            queue_scope: Set(to_json_array(&[q.id.as_str()])),
            revoked_at: Set(None),
            created_at: Set(t),
        }
        .insert(txn)
        .await?;

        Ok(BootstrapOutput {
            namespace_id: ns.id,
            application_id: app.id,
            queue_id: q.id,
            credential_id: cred.id,
            token,
            permissions: names,
        })
    })
    .await
}

fn to_json_array(items: &[&str]) -> String {
    serde_json::Value::from(items.to_vec()).to_string()
}

fn from_json_array(text: &str) -> Vec<String> {
    serde_json::from_str::<Vec<String>>(text).unwrap_or_default()
}

/// Builds the principal of a stored, unrevoked credential.
pub fn principal_of(cred: credential::Model) -> Option<Principal> {
    if cred.revoked_at.is_some() {
        return None;
    }
    let permissions = from_json_array(&cred.permissions)
        .iter()
        .filter_map(|p| Permission::parse(p))
        .collect();
    let queue_scope = from_json_array(&cred.queue_scope)
        .iter()
        .filter_map(|q| QueueId::parse(q))
        .collect();
    Some(Principal {
        credential_id: CredentialId::from_db(cred.id),
        namespace_id: NamespaceId::from_db(cred.namespace_id),
        application_id: ApplicationId::from_db(cred.application_id),
        permissions: PermissionSet::new(permissions),
        queue_scope,
    })
}

/// The principal of the credential whose token has `digest`, unless
/// revoked. On SQLite the row is read in place on the calling thread
/// (decision 0099), through the pool only when that read fails.
pub async fn principal_by_token_digest(
    db: &Database,
    digest: &str,
) -> Result<Option<Principal>, StoreError> {
    let found = match db.read_in_place(|c| sqlite::reads::credential_by_token_digest(c, digest)) {
        Some(found) => found,
        None => {
            credential::Entity::find()
                .filter(credential::Column::TokenDigest.eq(digest))
                .one(db.reader())
                .await?
        }
    };
    Ok(found.and_then(principal_of))
}

/// The current principal of a credential (`None` when unknown or revoked);
/// used to re-validate a session on ping and claim.
pub async fn principal_by_id<C: ConnectionTrait>(
    conn: &C,
    id: &CredentialId,
) -> Result<Option<Principal>, StoreError> {
    Ok(credential::Entity::find_by_id(id.as_str())
        .one(conn)
        .await?
        .and_then(principal_of))
}

/// [`principal_by_id`] of each of `ids` in one statement, by credential
/// id; an unknown or revoked credential is absent.
pub async fn principals_by_id<'a, C: ConnectionTrait>(
    conn: &C,
    ids: impl Iterator<Item = &'a CredentialId>,
) -> Result<HashMap<String, Principal>, StoreError> {
    let mut ids: Vec<&str> = ids.map(CredentialId::as_str).collect();
    ids.sort_unstable();
    ids.dedup();
    Ok(credential::Entity::find()
        .filter(credential::Column::Id.is_in(ids))
        .all(conn)
        .await?
        .into_iter()
        .filter_map(principal_of)
        .map(|p| (p.credential_id.as_str().to_owned(), p))
        .collect())
}

/// Revokes a credential. Returns when it was revoked (the original time if it
/// already was), or `None` when no such credential exists.
pub async fn revoke_credential(
    db: &Database,
    id: &CredentialId,
) -> Result<Option<Timestamp>, StoreError> {
    db.write_alone(async |txn| {
        let Some(cred) = credential::Entity::find_by_id(id.as_str()).one(txn).await? else {
            return Ok(None);
        };
        if let Some(at) = cred.revoked_at {
            return Ok(Some(Timestamp(at)));
        }
        let at = now();
        let mut active: credential::ActiveModel = cred.into();
        active.revoked_at = Set(Some(at.micros()));
        active.update(txn).await?;
        Ok(Some(at))
    })
    .await
}

/// One credential as `orbit-events credential list` shows it: who holds
/// access to what, and since when. It has no token nor token digest, so
/// printing it gives nothing away (spec: architecture.md §5).
#[derive(Debug, Serialize)]
pub struct CredentialListing {
    pub credential_id: String,
    pub namespace_id: String,
    /// `None` when the namespace row is missing (never written so).
    pub namespace: Option<String>,
    pub application_id: String,
    /// `None` when the application row is missing.
    pub application: Option<String>,
    /// Permission names as stored, e.g. `["events:read"]`; empty for a
    /// credential that can do nothing but get 403.
    pub permissions: Vec<String>,
    /// The queues the credential may touch; empty: none.
    pub queue_scope: Vec<ScopedQueue>,
    pub created_at: Timestamp,
    /// `None` while the credential works.
    pub revoked_at: Option<Timestamp>,
}

/// One queue of a credential's scope.
#[derive(Debug, Serialize)]
pub struct ScopedQueue {
    pub id: String,
    /// `None` when the queue row is missing.
    pub name: Option<String>,
}

/// Every credential of the database, revoked ones included, oldest first
/// (by `created_at`, then id), with the names of its namespace, application
/// and queues. Reads only: four queries outside a transaction, which is
/// enough since tenancy rows are never deleted. `Err`: the database failed
/// (e.g. it was never migrated).
pub async fn list_credentials<C: ConnectionTrait>(
    conn: &C,
) -> Result<Vec<CredentialListing>, StoreError> {
    let credentials = credential::Entity::find()
        .order_by_asc(credential::Column::CreatedAt)
        .order_by_asc(credential::Column::Id)
        .all(conn)
        .await?;
    if credentials.is_empty() {
        return Ok(Vec::new());
    }
    let scopes: Vec<Vec<String>> = credentials
        .iter()
        .map(|c| from_json_array(&c.queue_scope))
        .collect();

    let namespace_ids: BTreeSet<&str> = credentials
        .iter()
        .map(|c| c.namespace_id.as_str())
        .collect();
    let namespaces: HashMap<String, String> = namespace::Entity::find()
        .filter(namespace::Column::Id.is_in(namespace_ids))
        .all(conn)
        .await?
        .into_iter()
        .map(|n| (n.id, n.name))
        .collect();
    let application_ids: BTreeSet<&str> = credentials
        .iter()
        .map(|c| c.application_id.as_str())
        .collect();
    let applications: HashMap<String, String> = application::Entity::find()
        .filter(application::Column::Id.is_in(application_ids))
        .all(conn)
        .await?
        .into_iter()
        .map(|a| (a.id, a.name))
        .collect();
    let queue_ids: BTreeSet<&str> = scopes.iter().flatten().map(String::as_str).collect();
    let queues: HashMap<String, String> = if queue_ids.is_empty() {
        HashMap::new()
    } else {
        queue::Entity::find()
            .filter(queue::Column::Id.is_in(queue_ids))
            .all(conn)
            .await?
            .into_iter()
            .map(|q| (q.id, q.name))
            .collect()
    };

    Ok(credentials
        .into_iter()
        .zip(scopes)
        .map(|(c, scope)| CredentialListing {
            namespace: namespaces.get(&c.namespace_id).cloned(),
            application: applications.get(&c.application_id).cloned(),
            permissions: from_json_array(&c.permissions),
            queue_scope: scope
                .into_iter()
                .map(|id| ScopedQueue {
                    name: queues.get(&id).cloned(),
                    id,
                })
                .collect(),
            created_at: Timestamp(c.created_at),
            revoked_at: c.revoked_at.map(Timestamp),
            credential_id: c.id,
            namespace_id: c.namespace_id,
            application_id: c.application_id,
        })
        .collect())
}
