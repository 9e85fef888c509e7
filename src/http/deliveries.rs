//! `/v1/subscriptions/{id}/deliveries` (spec: http-api.md §3 "Deliveries",
//! delivery-model.md §6 "Retry").

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{
    auth::{self, Require},
    delivery::scanner::SubscriptionChanged,
    domain::{DeliveryId, DeliveryState, EventId, Permission, QueueId, U64Str},
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
        deliveries::{self, DeliveryView, Retry},
        idempotency::WriteIdentity,
        list_cursor::ListPosition,
        subscriptions,
    },
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
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let (sub_id, delivery_id) = path.into_inner();
    let sub = subscriptions::get_owned(state.db.reader(), &principal, &sub_id).await?;
    let sub_id = path_subscription_id(&sub.id)?;
    let delivery =
        deliveries::get_of_subscription(state.db.reader(), &sub_id, &delivery_id).await?;
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
        state.scanner.do_send(SubscriptionChanged {
            subscription_id: sub_id,
            rows_available: true,
        });
    }
    Ok(written.response)
}
