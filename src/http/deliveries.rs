//! `/v1/subscriptions/{id}/deliveries` (spec: http-api.md §3 "Deliveries",
//! delivery-model.md §6 "Retry").

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{
    auth::{self, Require},
    delivery::scanner::SubscriptionChanged,
    domain::{DeliveryId, DeliveryState, EventId, Permission, QueueId, Timestamp, U64Str, now},
    error::{Error, Result},
    http::{
        envelope::respond,
        lists::{binding, check_cursor_shape, next_cursor, resume_after},
        openapi::{DeliveryDetail, DeliveryResult, Envelope, ErrorEnvelope, Page, Uint64String},
        request::{idempotency_key, json_body, list_limit, no_query, query_params},
        subscriptions::{path_subscription_id, validate_reason},
        write::{idempotent_write, to_data},
    },
    journal::{self, RenderedEvent},
    state::AppState,
    store::{
        audit::{self, AuditActor, AuditEntry},
        deliveries::{self, BulkReceipt, BulkRetry, DeliveryView, Retry},
        history::{self, Step},
        idempotency::{self, Begin, WriteIdentity},
        list_cursor::ListPosition,
        subscriptions,
    },
    strict_json::non_null,
};

/// Body of `POST .../deliveries/{delivery_id}:retry`: all three required.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RetryDeliveryRequest)]
pub struct RetryBody {
    /// Must equal the delivery's current revision.
    #[schema(value_type = Uint64String)]
    pub expected_revision: U64Str,
    /// Why; kept in the audit record. 1–1024 Unicode scalar values, no NUL.
    #[schema(min_length = 1, max_length = 1024, pattern = r"^[^\u0000]+$")]
    pub reason: String,
    /// Added to `attempt_budget` (cumulative at most 1,000,000).
    #[schema(minimum = 1, maximum = 100)]
    pub additional_attempts: u32,
}

/// Attempts one retry may add.
const MAX_ADDITIONAL_ATTEMPTS: u32 = 100;

/// `GET /v1/subscriptions/{id}/deliveries[?state=&limit=&cursor=]`
/// (events:read): newest first.
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}/deliveries",
    tag = "deliveries",
    operation_id = "listDeliveries",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("state" = Option<crate::http::openapi::DeliveryStateName>, Query, description = "Only deliveries in this state"),
        ("limit" = Option<String>, Query, pattern = "^([1-9]|[1-9][0-9]|100)$", description = "Page size 1–100 (default 20), a canonical decimal"),
        ("cursor" = Option<String>, Query, pattern = r"^[A-Za-z0-9_.\-]{1,256}$", description = "`next_cursor` of the previous page, with the same `state`"),
    ),
    responses(
        (status = 200, description = "One page", body = Envelope<Page<DeliveryView>>),
        (status = 404, description = "Unknown subscription, or not this credential's", body = ErrorEnvelope),
    )
)]
pub async fn list(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    let params = query_params(&req, &["state", "limit", "cursor"])?;
    let filter = match params.get("state") {
        None => None,
        Some(s) => Some(DeliveryState::parse(s).ok_or_else(|| {
            Error::invalid_argument("state: must be PENDING, LEASED, ACKED or EXPIRED")
        })?),
    };
    let limit = list_limit(params.get("limit").map(String::as_str))?;
    let cursor = params.get("cursor");
    check_cursor_shape(cursor)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let sub = subscriptions::get_owned(state.db.reader(), &principal, &path).await?;
    let sub_id = path_subscription_id(&sub.id)?;
    let binding = binding(
        &principal,
        "deliveries",
        sub.id.as_str(),
        filter.map(DeliveryState::as_str),
    );
    let after = resume_after(&state, &binding, cursor).await?;
    let page =
        deliveries::list_page(state.db.reader(), &sub_id, filter, after.as_ref(), limit).await?;
    let last = page.items.last().map(|d| ListPosition {
        created_at: d.created_at,
        id: d.id.clone(),
    });
    let next_cursor = next_cursor(&state, &binding, page.more, last).await?;
    Ok(respond(
        &req,
        StatusCode::OK,
        Page {
            items: page.items.iter().map(DeliveryView::from).collect(),
            next_cursor,
        },
    ))
}

/// `data` of the delivery detail: `{delivery, event}`.
#[derive(Serialize)]
struct Detail {
    delivery: DeliveryView,
    event: RenderedEvent,
}

/// `GET /v1/subscriptions/{id}/deliveries/{delivery_id}` (events:read):
/// the delivery and its event; never a lease secret or digest.
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}/deliveries/{delivery_id}",
    tag = "deliveries",
    operation_id = "getDelivery",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("delivery_id" = String, Path, description = "Delivery id"),
    ),
    responses(
        (status = 200, description = "The delivery and its event", body = Envelope<DeliveryDetail>),
        (status = 404, description = "Unknown, not this credential's, or a delivery of another subscription", body = ErrorEnvelope),
        (status = 410, description = "EVENT_HISTORY_EXPIRED: the delivery's event was purged by retention", body = ErrorEnvelope),
    )
)]
pub async fn get(
    req: HttpRequest,
    path: web::Path<(String, String)>,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    let (sub, delivery) = owned_delivery(&req, &state, path.into_inner()).await?;
    let event_id = EventId::from_db(delivery.event_id.clone());
    let mut events = journal::render(state.db.reader(), std::slice::from_ref(&event_id)).await?;
    let Some(event) = events.remove(&event_id) else {
        let floor = journal::position(state.db.reader(), &QueueId::from_db(sub.queue_id))
            .await?
            .map(|p| p.earliest())
            .unwrap_or(1);
        return Err(Error::history_expired(floor));
    };
    Ok(respond(
        &req,
        StatusCode::OK,
        Detail {
            delivery: DeliveryView::from(&delivery),
            event,
        },
    ))
}

/// `POST /v1/subscriptions/{id}/deliveries/{delivery_id}:retry`
/// (events:manage): re-arms an EXPIRED delivery with more attempts; wakes
/// the scanner after commit.
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
    tag = "deliveries",
    operation_id = "retryDelivery",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("delivery_id" = String, Path, description = "Delivery id"),
        ("Idempotency-Key" = String, Header, pattern = r"^[!-~]{1,255}$",
         description = "1–255 visible ASCII characters, scoped to the credential"),
    ),
    request_body(content = RetryBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Re-armed: PENDING again (or a replay: the original snapshot, `deduplicated: true`)", body = Envelope<DeliveryResult>),
        (status = 404, description = "Unknown, not this credential's, or a delivery of another subscription", body = ErrorEnvelope),
        (status = 409, description = "STATE_CONFLICT (not EXPIRED, `expected_revision` stale, or the budget would pass 1,000,000) or IDEMPOTENCY_CONFLICT", body = ErrorEnvelope),
    )
)]
pub async fn retry(
    req: HttpRequest,
    path: web::Path<(String, String)>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsManage)?;
    let key = idempotency_key(&req)?;
    let body: RetryBody = json_body(&req, payload).await?;
    if !(1..=MAX_ADDITIONAL_ATTEMPTS).contains(&body.additional_attempts) {
        return Err(Error::invalid_argument(
            "additional_attempts: must be 1 to 100",
        ));
    }
    let retry = Retry {
        expected_revision: body.expected_revision.0,
        reason: validate_reason(body.reason)?,
        additional_attempts: body.additional_attempts,
    };
    let (sub_id, delivery_id) = path.into_inner();
    let sub_id = path_subscription_id(&sub_id)?;
    if DeliveryId::parse(&delivery_id).is_none() {
        return Err(Error::not_found("delivery not found"));
    }
    let identity = WriteIdentity::new(
        &principal.credential_id,
        key,
        "deliveries.retry",
        format!("{}/{}", sub_id.as_str(), delivery_id),
        &retry,
    )?;
    let target = sub_id.clone();
    let credential_id = principal.credential_id.clone();
    let additional_attempts = retry.additional_attempts;
    let logged_delivery = delivery_id.clone();
    let written = idempotent_write(&req, &state, identity, StatusCode::OK, |txn| {
        Box::pin(async move {
            let model =
                deliveries::retry_delivery(txn, &principal, &target, &delivery_id, &retry).await?;
            to_data(&DeliveryResult {
                delivery: DeliveryView::from(&model),
                deduplicated: false,
            })
        })
    })
    .await?;
    if written.applied {
        tracing::info!(
            subscription_id = %sub_id,
            delivery_id = %logged_delivery,
            %credential_id,
            additional_attempts,
            "delivery re-armed by a retry"
        );
        state.scanner.do_send(SubscriptionChanged {
            subscription_id: sub_id,
            rows_available: true,
        });
    }
    Ok(written.response)
}

/// `data` of a delivery's history: its steps, oldest first.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = DeliveryHistory)]
pub struct History {
    pub items: Vec<Step>,
}

/// `GET /v1/subscriptions/{id}/deliveries/{delivery_id}/history`
/// (events:read): every step of the delivery, oldest first — materialized,
/// each lease and how it ended, refused ACKs, a session closing while it
/// held the lease, admin retries, the ACK (decision 0081). Kept as long as
/// the delivery.
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}/deliveries/{delivery_id}/history",
    tag = "deliveries",
    operation_id = "getDeliveryHistory",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("delivery_id" = String, Path, description = "Delivery id"),
    ),
    responses(
        (status = 200, description = "The steps, oldest first", body = Envelope<History>),
        (status = 404, description = "Unknown, not this credential's, or a delivery of another subscription", body = ErrorEnvelope),
    )
)]
pub async fn history(
    req: HttpRequest,
    path: web::Path<(String, String)>,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    let (_, delivery) = owned_delivery(&req, &state, path.into_inner()).await?;
    let items = history::steps_of(state.db.reader(), &delivery).await?;
    Ok(respond(&req, StatusCode::OK, History { items }))
}

/// The reads of one delivery (events:read, no query string): the
/// subscription when it is the caller's, and its delivery `(subscription
/// id, delivery id)`; 404 otherwise.
async fn owned_delivery(
    req: &HttpRequest,
    state: &AppState,
    (sub_id, delivery_id): (String, String),
) -> Result<(entity::subscription::Model, entity::delivery::Model)> {
    no_query(req)?;
    let principal = auth::authenticate(req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let sub = subscriptions::get_owned(state.db.reader(), &principal, &sub_id).await?;
    let sub_id = path_subscription_id(&sub.id)?;
    let delivery =
        deliveries::get_of_subscription(state.db.reader(), &sub_id, &delivery_id).await?;
    Ok((sub, delivery))
}

/// Body of `POST /v1/subscriptions/{id}/deliveries:retry`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = BulkRetryRequest)]
pub struct BulkRetryBody {
    /// Why; kept in the one audit record of the operation. 1–1024
    /// Unicode scalar values, no NUL.
    #[schema(min_length = 1, max_length = 1024, pattern = r"^[^\u0000]+$")]
    pub reason: String,
    /// Added to each delivery's `attempt_budget` (cumulative at most
    /// 1,000,000; a delivery that would pass it is left EXPIRED).
    #[schema(minimum = 1, maximum = 100)]
    pub additional_attempts: u32,
    /// Lowest sequence to re-arm (inclusive); omitted: from the first.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub from_sequence: Option<U64Str>,
    /// Highest sequence to re-arm (inclusive); omitted: to the last.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub to_sequence: Option<U64Str>,
    /// At most this many deliveries, lowest sequence first: 1–10000.
    #[schema(minimum = 1, maximum = 10000)]
    pub limit: u32,
    /// Count what would be re-armed; write nothing.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(nullable = false)]
    pub dry_run: Option<bool>,
    /// Make the re-armed deliveries available evenly over this many
    /// milliseconds (0–3600000) instead of all at once.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(nullable = false, minimum = 0, maximum = 3600000)]
    pub spread_ms: Option<u32>,
}

/// Deliveries one bulk retry may name.
const MAX_BULK_LIMIT: u32 = 10_000;
/// The longest spread of a bulk retry, in ms (one hour).
const MAX_SPREAD_MS: u32 = 3_600_000;
/// How long a bulk retry's key is held before it is finished (a node
/// killed in the middle releases it after this).
const BULK_KEY_HOLD: std::time::Duration = std::time::Duration::from_secs(600);

/// `POST /v1/subscriptions/{id}/deliveries:retry` (events:manage): re-arms
/// the EXPIRED deliveries in a sequence range, lowest first, in
/// transactions of at most 500; one audit record for the operation; a
/// replay of the key answers the original receipt. A dry run counts and
/// writes nothing (decision 0081).
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}/deliveries:retry",
    tag = "deliveries",
    operation_id = "retryDeliveries",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("Idempotency-Key" = String, Header, pattern = r"^[!-~]{1,255}$",
         description = "1–255 visible ASCII characters, scoped to the credential"),
    ),
    request_body(content = BulkRetryBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The receipt (or a replay of it, `deduplicated: true`)", body = Envelope<BulkReceipt>),
        (status = 404, description = "Unknown subscription, or not this credential's", body = ErrorEnvelope),
        (status = 409, description = "IDEMPOTENCY_CONFLICT: the key was used for another request, or its request is still running", body = ErrorEnvelope),
    )
)]
pub async fn bulk_retry(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsManage)?;
    let key = idempotency_key(&req)?;
    let body: BulkRetryBody = json_body(&req, payload).await?;
    let bulk = validate_bulk(body)?;
    let sub = subscriptions::get_owned(state.db.reader(), &principal, &path).await?;
    let sub_id = path_subscription_id(&sub.id)?;
    let identity = WriteIdentity::new(
        &principal.credential_id,
        key,
        "deliveries.bulk_retry",
        sub_id.as_str(),
        &bulk,
    )?;
    if bulk.dry_run {
        // A dry run writes nothing, not even its key; a key already used
        // for another request is still 409.
        if let Some(data) = idempotency::peek(state.db.reader(), &identity, now()).await? {
            return Ok(respond(&req, StatusCode::OK, data));
        }
        let matched = deliveries::expired_in_range(
            state.db.reader(),
            &sub_id,
            &bulk,
            None,
            u64::from(bulk.limit),
        )
        .await?;
        let receipt = BulkReceipt {
            matched: matched.len() as u64,
            retried: 0,
            first_sequence: matched.first().map(|(_, s)| s.to_string()),
            last_sequence: matched.last().map(|(_, s)| s.to_string()),
            dry_run: true,
            deduplicated: false,
        };
        return Ok(respond(&req, StatusCode::OK, receipt));
    }
    let t = now();
    let claimed = state
        .db
        .write_alone(async |txn| {
            idempotency::begin_held(txn, &identity, t, t.plus(BULK_KEY_HOLD)).await
        })
        .await?;
    if let Begin::Replay(data) = claimed {
        return Ok(respond(&req, StatusCode::OK, data));
    }
    match run_bulk_retry(&state, &principal, &sub_id, &bulk, &identity).await {
        Ok((receipt, data)) => {
            if receipt.retried > 0 {
                tracing::info!(
                    subscription_id = %sub_id,
                    credential_id = %principal.credential_id,
                    matched = receipt.matched,
                    retried = receipt.retried,
                    "expired deliveries re-armed by a bulk retry"
                );
                wake_over_spread(&state, &sub_id, bulk.spread_ms);
            }
            Ok(respond(&req, StatusCode::OK, data))
        }
        Err(err) => {
            // Deliveries re-armed so far stay re-armed (each batch
            // committed); the key is free for the same request again.
            if let Err(e) = state
                .db
                .write_alone(async |txn| idempotency::abandon(txn, &identity).await)
                .await
            {
                crate::store::writer::log_failure(&e, "could not release a bulk retry's key");
            }
            Err(err)
        }
    }
}

fn validate_bulk(body: BulkRetryBody) -> Result<BulkRetry> {
    if !(1..=MAX_ADDITIONAL_ATTEMPTS).contains(&body.additional_attempts) {
        return Err(Error::invalid_argument(
            "additional_attempts: must be 1 to 100",
        ));
    }
    if !(1..=MAX_BULK_LIMIT).contains(&body.limit) {
        return Err(Error::invalid_argument(format!(
            "limit: must be 1 to {MAX_BULK_LIMIT} (run several retries for more)"
        )));
    }
    if body.spread_ms.is_some_and(|s| s > MAX_SPREAD_MS) {
        return Err(Error::invalid_argument(format!(
            "spread_ms: must be 0 to {MAX_SPREAD_MS}"
        )));
    }
    let from_sequence = body.from_sequence.map(|s| s.0);
    let to_sequence = body.to_sequence.map(|s| s.0);
    if let (Some(from), Some(to)) = (from_sequence, to_sequence)
        && from > to
    {
        return Err(Error::invalid_argument(
            "from_sequence: must not be above to_sequence",
        ));
    }
    Ok(BulkRetry {
        reason: validate_reason(body.reason)?,
        additional_attempts: body.additional_attempts,
        from_sequence,
        to_sequence,
        limit: body.limit,
        dry_run: body.dry_run.unwrap_or(false),
        spread_ms: body.spread_ms.filter(|&s| s > 0),
    })
}

/// The batches of a bulk retry, then its audit record and its receipt
/// under the key (one last transaction).
async fn run_bulk_retry(
    state: &AppState,
    principal: &crate::domain::Principal,
    sub_id: &crate::domain::SubscriptionId,
    bulk: &BulkRetry,
    identity: &WriteIdentity,
) -> Result<(BulkReceipt, serde_json::Value)> {
    let audit_id = crate::domain::ordered_hex_id();
    let t = now();
    let spread_micros = i64::from(bulk.spread_ms.unwrap_or(0)) * 1000;
    let limit = u64::from(bulk.limit);
    // The spread is shared by the deliveries there are, not by `limit`
    // (at most max_pending rows: a cheap read).
    let expected = match bulk.spread_ms {
        Some(_) => deliveries::expired_in_range(state.db.reader(), sub_id, bulk, None, limit)
            .await?
            .len()
            .max(1),
        None => 1,
    };
    let expected = i64::try_from(expected).unwrap_or(i64::MAX);
    let (mut matched, mut sequences) = (0u64, Vec::<i64>::new());
    let mut after = None;
    while matched < limit {
        let n = (limit - matched).min(deliveries::BULK_RETRY_BATCH);
        let start = matched;
        let batch = state
            .db
            .write_alone(async |txn| {
                let ids = deliveries::expired_in_range(txn, sub_id, bulk, after, n).await?;
                // Evenly over the spread, by position in the whole run.
                let at = |i: usize| {
                    let k = i64::try_from(start + i as u64).unwrap_or(i64::MAX);
                    Timestamp(t.micros() + spread_micros * k.min(expected) / expected)
                };
                let rearmed = deliveries::rearm_expired(
                    txn,
                    &ids,
                    &at,
                    bulk.additional_attempts,
                    &audit_id,
                    now(),
                )
                .await?;
                Ok::<_, Error>((ids, rearmed))
            })
            .await?;
        let (ids, rearmed) = batch;
        matched += ids.len() as u64;
        sequences.extend(rearmed);
        after = ids.last().map(|(_, s)| *s);
        if (ids.len() as u64) < n {
            break;
        }
    }
    let receipt = BulkReceipt {
        matched,
        retried: sequences.len() as u64,
        first_sequence: sequences.iter().min().map(i64::to_string),
        last_sequence: sequences.iter().max().map(i64::to_string),
        dry_run: false,
        deduplicated: false,
    };
    let data = to_data(&receipt)?;
    let ttl = std::time::Duration::from_secs(state.settings.retention.idempotency_max_age_s);
    let done = now();
    state
        .db
        .write_alone(async |txn| {
            audit::record_with_id(
                txn,
                &audit_id,
                &AuditActor {
                    namespace_id: principal.namespace_id.clone(),
                    credential_id: principal.credential_id.clone(),
                },
                AuditEntry {
                    action: "deliveries.bulk_retry",
                    target_id: sub_id.as_str(),
                    reason: Some(&bulk.reason),
                    before_revision: None,
                    after_revision: None,
                    at: done,
                },
            )
            .await?;
            idempotency::finish(
                txn,
                identity,
                StatusCode::OK.as_u16(),
                &data,
                done.plus(ttl),
            )
            .await?;
            Ok::<_, Error>(())
        })
        .await?;
    Ok((receipt, data))
}

/// Wakes the subscription's claims now and, over a spread, as the re-armed
/// deliveries come due (a claim leases only rows whose `available_at` has
/// passed).
fn wake_over_spread(
    state: &AppState,
    sub_id: &crate::domain::SubscriptionId,
    spread_ms: Option<u32>,
) {
    let wake = {
        let scanner = state.scanner.clone();
        let sub_id = sub_id.clone();
        move || {
            scanner.do_send(SubscriptionChanged {
                subscription_id: sub_id.clone(),
                rows_available: true,
            })
        }
    };
    wake();
    let Some(spread) = spread_ms else { return };
    let spread = std::time::Duration::from_millis(u64::from(spread));
    let step = (spread / 20).max(std::time::Duration::from_millis(50));
    actix::spawn(async move {
        let mut waited = std::time::Duration::ZERO;
        while waited <= spread {
            actix::clock::sleep(step).await;
            waited += step;
            wake();
        }
    });
}
