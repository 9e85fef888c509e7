//! Subscriptions: create, read with ownership, list, configure
//! (spec: delivery-model.md §4, http-api.md §3).

use entity::{namespace, queue, subscription};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseTransaction, EntityTrait,
    PaginatorTrait, QueryFilter, Set,
};
use serde::Serialize;

use crate::{
    auth::Principal,
    domain::{QueueId, SubscriptionId, SubscriptionName, Timestamp, TypeSet, now},
    error::{Error, Result},
    store::{is_unique_violation, lock_for_update},
};

/// The subscription object of the API.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SubscriptionView {
    pub id: String,
    pub queue_id: String,
    pub credential_id: String,
    pub name: String,
    /// uint64 string.
    pub revision: String,
    pub enabled: bool,
    /// Canonical order.
    pub types: Vec<&'static str>,
    /// uint64 string: how far the scanner has read (not an ACK watermark).
    pub cursor_sequence: String,
    pub pending_count: i64,
    pub max_pending: i32,
    pub max_attempts: i32,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

impl From<&subscription::Model> for SubscriptionView {
    fn from(m: &subscription::Model) -> SubscriptionView {
        SubscriptionView {
            id: m.id.clone(),
            queue_id: m.queue_id.clone(),
            credential_id: m.credential_id.clone(),
            name: m.name.clone(),
            revision: m.revision.to_string(),
            enabled: m.enabled,
            types: TypeSet::from_db(&m.types)
                .to_vec()
                .into_iter()
                .map(|t| t.as_str())
                .collect(),
            cursor_sequence: m.cursor_sequence.to_string(),
            pending_count: m.pending_count,
            max_pending: m.max_pending,
            max_attempts: m.max_attempts,
            created_at: Timestamp(m.created_at),
            updated_at: Timestamp(m.updated_at),
        }
    }
}

/// A validated create request, defaults applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewSubscription {
    #[serde(serialize_with = "ser_name")]
    pub name: SubscriptionName,
    pub queue_id: QueueId,
    #[serde(serialize_with = "ser_types")]
    pub types: TypeSet,
    /// `None`: start at the committed head at creation.
    pub from_sequence: Option<u64>,
    pub max_pending: u32,
    pub max_attempts: u32,
}

fn ser_name<S: serde::Serializer>(n: &SubscriptionName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(n.as_str())
}

fn ser_types<S: serde::Serializer>(t: &TypeSet, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.to_db())
}

/// Creates a subscription inside the caller's transaction. Errors, in
/// order: 404 (queue unknown or outside scope), 400 (`from_sequence` above
/// the head), 410 (below the retention floor), 409 `STATE_CONFLICT` (name
/// taken), 409 `SUBSCRIPTION_LIMIT`.
pub async fn create_subscription(
    txn: &DatabaseTransaction,
    principal: &Principal,
    new: &NewSubscription,
    max_per_namespace: u64,
) -> Result<subscription::Model> {
    if !principal.in_scope(&new.queue_id) {
        return Err(Error::not_found("queue not found"));
    }
    let backend = txn.get_database_backend();
    // Serializes creates within a namespace so the limit holds exactly.
    lock_for_update(
        namespace::Entity::find_by_id(principal.namespace_id.as_str()),
        backend,
    )
    .one(txn)
    .await?;
    let queue = queue::Entity::find_by_id(new.queue_id.as_str())
        .one(txn)
        .await?
        .filter(|q| q.namespace_id == principal.namespace_id.as_str())
        .ok_or_else(|| Error::not_found("queue not found"))?;

    let cursor = match new.from_sequence {
        None => queue.head_sequence,
        Some(n) => {
            let head = u64::try_from(queue.head_sequence).unwrap_or(0);
            if n > head {
                return Err(Error::invalid_argument(format!(
                    "from_sequence: {n} is above the committed head {head}"
                )));
            }
            let n = i64::try_from(n).unwrap_or(i64::MAX);
            if n < queue.retention_floor {
                let earliest = u64::try_from(queue.retention_floor).unwrap_or(0) + 1;
                return Err(Error::history_expired(earliest));
            }
            n
        }
    };

    let taken = subscription::Entity::find()
        .filter(subscription::Column::NamespaceId.eq(principal.namespace_id.as_str()))
        .filter(subscription::Column::Name.eq(new.name.as_str()))
        .count(txn)
        .await?;
    if taken > 0 {
        return Err(Error::state_conflict(format!(
            "name: a subscription named {} already exists in this namespace",
            new.name.as_str()
        )));
    }
    let in_namespace = subscription::Entity::find()
        .filter(subscription::Column::NamespaceId.eq(principal.namespace_id.as_str()))
        .count(txn)
        .await?;
    if in_namespace >= max_per_namespace {
        return Err(Error::new(
            crate::error::ErrorCode::SubscriptionLimit,
            format!("the namespace already has {max_per_namespace} subscriptions"),
        ));
    }

    let t = now().micros();
    let model = subscription::ActiveModel {
        id: Set(SubscriptionId::generate().into_string()),
        namespace_id: Set(principal.namespace_id.as_str().to_owned()),
        application_id: Set(principal.application_id.as_str().to_owned()),
        credential_id: Set(principal.credential_id.as_str().to_owned()),
        queue_id: Set(new.queue_id.as_str().to_owned()),
        name: Set(new.name.as_str().to_owned()),
        revision: Set(1),
        enabled: Set(true),
        types: Set(new.types.to_db()),
        cursor_sequence: Set(cursor),
        pending_count: Set(0),
        max_pending: Set(new.max_pending as i32),
        max_attempts: Set(new.max_attempts as i32),
        created_at: Set(t),
        updated_at: Set(t),
    };
    model.insert(txn).await.map_err(|err| {
        if is_unique_violation(&err) {
            Error::state_conflict(format!(
                "name: a subscription named {} already exists in this namespace",
                new.name.as_str()
            ))
        } else {
            err.into()
        }
    })
}

/// The subscription `id` if it belongs to this credential and its queue is
/// in scope; 404 otherwise (never a hint that it exists).
pub async fn get_owned<C: ConnectionTrait>(
    conn: &C,
    principal: &Principal,
    id: &str,
) -> Result<subscription::Model> {
    let not_found = || Error::not_found("subscription not found");
    let id = SubscriptionId::parse(id).ok_or_else(not_found)?;
    let model = subscription::Entity::find_by_id(id.as_str())
        .one(conn)
        .await?
        .ok_or_else(not_found)?;
    owned(principal, model).ok_or_else(not_found)
}

/// `Some(model)` when `principal` owns it and its queue is in scope.
pub fn owned(principal: &Principal, model: subscription::Model) -> Option<subscription::Model> {
    let queue_ok = QueueId::parse(&model.queue_id).is_some_and(|q| principal.in_scope(&q));
    (model.credential_id == principal.credential_id.as_str() && queue_ok).then_some(model)
}
