//! Subscriptions: create, read with ownership, list, configure
//! (spec: delivery-model.md §4, http-api.md §3).

use entity::{namespace, queue, subscription};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, Condition, ConnectionTrait, DatabaseTransaction, EntityTrait,
    ExprTrait, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, Set, sea_query::Expr,
};
use serde::Serialize;

use crate::store::StoreError;
use crate::{
    domain::Principal,
    domain::schema::{Id, ResultTypeName, Time, Uint64String},
    domain::{QueueId, SubscriptionId, SubscriptionName, Timestamp, TypeSet, now},
    error::{Error, Result},
    store::{
        audit::{self, AuditActor, AuditEntry},
        is_unique_violation,
        list_cursor::ListPosition,
        lock_for_update, tallies,
    },
};

/// The subscription object of the API (spec: http-api.md §3).
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Subscription)]
pub struct SubscriptionView {
    #[schema(value_type = Id)]
    pub id: String,
    #[schema(value_type = Id)]
    pub queue_id: String,
    #[schema(value_type = Id)]
    pub credential_id: String,
    pub name: String,
    /// Grows by 1 on every configure; materialization and ACKs never change it.
    #[schema(value_type = Uint64String)]
    pub revision: String,
    pub enabled: bool,
    /// Canonical order: task.cancelled, task.failed, task.needs_review, task.succeeded.
    #[schema(value_type = Vec<ResultTypeName>)]
    pub types: Vec<&'static str>,
    /// How far the scanner has read the log and created deliveries (not an
    /// ACK watermark).
    #[schema(value_type = Uint64String)]
    pub cursor_sequence: String,
    /// Deliveries in PENDING, LEASED or EXPIRED; at most `max_pending`.
    #[schema(minimum = 0)]
    pub pending_count: i64,
    #[schema(minimum = 1, maximum = 1000)]
    pub max_pending: i32,
    #[schema(minimum = 1, maximum = 100)]
    pub max_attempts: i32,
    #[schema(value_type = Time)]
    pub created_at: Timestamp,
    #[schema(value_type = Time)]
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
    find_owned(conn, principal, id)
        .await?
        .ok_or_else(|| Error::not_found("subscription not found"))
}

/// The subscription `id` if it belongs to this credential and its queue is
/// in scope; `None` otherwise (also for an id that is not one).
pub async fn find_owned<C: ConnectionTrait>(
    conn: &C,
    principal: &Principal,
    id: &str,
) -> Result<Option<subscription::Model>, StoreError> {
    let Some(id) = SubscriptionId::parse(id) else {
        return Ok(None);
    };
    let model = subscription::Entity::find_by_id(id.as_str())
        .one(conn)
        .await?;
    let mut owned: Vec<_> = model
        .and_then(|m| owned(principal, m))
        .into_iter()
        .collect();
    tallies::settle(conn, &mut owned).await?;
    Ok(owned.pop())
}

/// `Some(model)` when `principal` owns it and its queue is in scope.
pub fn owned(principal: &Principal, model: subscription::Model) -> Option<subscription::Model> {
    let queue_ok = QueueId::parse(&model.queue_id).is_some_and(|q| principal.in_scope(&q));
    (model.credential_id == principal.credential_id.as_str() && queue_ok).then_some(model)
}

/// One page of a list in `created_at DESC, id DESC` order; `more` is true
/// when rows follow the last one.
#[derive(Debug)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub more: bool,
}

/// Rows strictly after `after` in `created_at DESC, id DESC` order, as
/// the row comparison `(created_at, id) < (…, …)`: both planners make it
/// part of the index range on `(…, created_at DESC, id DESC)`, so a later
/// page starts where the previous one ended instead of walking every newer
/// row (the equivalent `created_at < … OR (created_at = … AND id < …)` is
/// only a filter on PostgreSQL; decision 0065).
pub(crate) fn after_position<C: ColumnTrait>(
    created_at: C,
    id: C,
    after: &ListPosition,
) -> Condition {
    Condition::all().add(
        Expr::tuple([Expr::col(created_at), Expr::col(id)]).lt(Expr::tuple([
            Expr::val(after.created_at),
            Expr::val(after.id.as_str()),
        ])),
    )
}

/// This credential's subscriptions on `queue_id`, newest first, at most
/// `limit`, after `after` (spec: http-api.md §3 "Get / list").
pub async fn list_page<C: ConnectionTrait>(
    conn: &C,
    principal: &Principal,
    queue_id: &QueueId,
    after: Option<&ListPosition>,
    limit: u64,
) -> Result<Page<subscription::Model>> {
    let mut query = subscription::Entity::find()
        .filter(subscription::Column::CredentialId.eq(principal.credential_id.as_str()))
        .filter(subscription::Column::QueueId.eq(queue_id.as_str()));
    if let Some(after) = after {
        query = query.filter(after_position(
            subscription::Column::CreatedAt,
            subscription::Column::Id,
            after,
        ));
    }
    let mut items = query
        .order_by_desc(subscription::Column::CreatedAt)
        .order_by_desc(subscription::Column::Id)
        .limit(limit + 1)
        .all(conn)
        .await?;
    let more = items.len() as u64 > limit;
    items.truncate(limit as usize);
    tallies::settle(conn, &mut items).await?;
    Ok(Page { items, more })
}

/// A validated configure request (spec: http-api.md §3 "Configure").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Configure {
    pub expected_revision: u64,
    pub enabled: bool,
    /// 1–1024 Unicode scalar values.
    pub reason: String,
}

/// Pauses or resumes a subscription inside the caller's transaction: 404
/// unless owned; 409 `STATE_CONFLICT` unless `expected_revision` equals the
/// current revision. Sets `enabled`, bumps `revision` (also when `enabled`
/// does not change) and writes an audit record. Returns the row after the
/// change. The caller wakes the scanner after commit on a resume.
pub async fn configure(
    txn: &DatabaseTransaction,
    principal: &Principal,
    id: &SubscriptionId,
    change: &Configure,
) -> Result<subscription::Model> {
    let not_found = || Error::not_found("subscription not found");
    let backend = txn.get_database_backend();
    let current = lock_for_update(subscription::Entity::find_by_id(id.as_str()), backend)
        .one(txn)
        .await?
        .and_then(|m| owned(principal, m))
        .ok_or_else(not_found)?;
    if u64::try_from(current.revision).ok() != Some(change.expected_revision) {
        return Err(Error::state_conflict(format!(
            "expected_revision: the subscription is at revision {}, not {}",
            current.revision, change.expected_revision
        )));
    }
    let t = now();
    let after = current.revision + 1;
    // Only these columns: the scanner owns cursor_sequence and pending_count.
    subscription::Entity::update_many()
        .col_expr(subscription::Column::Enabled, Expr::value(change.enabled))
        .col_expr(subscription::Column::Revision, Expr::value(after))
        .col_expr(subscription::Column::UpdatedAt, Expr::value(t.micros()))
        .filter(subscription::Column::Id.eq(id.as_str()))
        .exec(txn)
        .await?;
    audit::record(
        txn,
        &AuditActor {
            namespace_id: principal.namespace_id.clone(),
            credential_id: principal.credential_id.clone(),
        },
        AuditEntry {
            action: if change.enabled {
                "subscription.resume"
            } else {
                "subscription.pause"
            },
            target_id: id.as_str(),
            reason: Some(&change.reason),
            before_revision: Some(current.revision),
            after_revision: Some(after),
            at: t,
        },
    )
    .await?;
    let mut after = subscription::Entity::find_by_id(id.as_str())
        .one(txn)
        .await?
        .ok_or_else(|| Error::internal("a configured subscription vanished"))?;
    tallies::settle(txn, std::slice::from_mut(&mut after)).await?;
    Ok(after)
}
