//! `/v1/subscriptions` (spec: http-api.md §3, delivery-model.md §4).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::{
    auth::{self, Require},
    delivery::scanner::SubscriptionChanged,
    domain::{Permission, QueueId, ResultType, SubscriptionId, SubscriptionName, TypeSet, U64Str},
    error::{Error, Result},
    http::{
        envelope::respond,
        lists::{binding, check_cursor_shape, next_cursor, resume_after},
        openapi::{Envelope, Page, ResultTypeList, SubscriptionResult, Uint64String},
        request::{idempotency_key, json_body, list_limit, no_query, query_params},
        write::{idempotent_write, to_data},
    },
    state::AppState,
    store::{
        self,
        idempotency::WriteIdentity,
        list_cursor::ListPosition,
        status::Status,
        subscriptions::{self, Configure, NewSubscription, SubscriptionView},
    },
    strict_json::non_null,
};

/// Default and range of `max_pending` (0 or omitted → 100; else 1–1000).
const DEFAULT_MAX_PENDING: u32 = 100;
const MAX_MAX_PENDING: u32 = 1000;
/// Default and range of `max_attempts` (0 or omitted → 20; else 1–100).
const DEFAULT_MAX_ATTEMPTS: u32 = 20;
const MAX_MAX_ATTEMPTS: u32 = 100;
/// Longest `reason` of a configure or retry, in Unicode scalar values.
pub const MAX_REASON_CHARS: usize = 1024;

/// Body of `POST /v1/subscriptions`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CreateSubscriptionRequest)]
pub struct CreateSubscriptionBody {
    /// Unique in the namespace.
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub name: String,
    /// A queue in the credential's scope.
    #[schema(value_type = crate::http::openapi::Id)]
    pub queue_id: String,
    #[serde(default, deserialize_with = "non_null")]
    #[schema(value_type = Option<ResultTypeList>, nullable = false)]
    pub types: Option<Vec<String>>,
    /// Omitted or null: start after the committed head; `"0"`: everything
    /// still retained; `"N"`: the first event delivered is N+1.
    #[serde(default)]
    #[schema(value_type = Option<Uint64String>)]
    pub from_sequence: Option<U64Str>,
    /// 0 or omitted: 100; else 1–1000.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(nullable = false, minimum = 0, maximum = 1000)]
    pub max_pending: Option<u32>,
    /// 0 or omitted: 20; else 1–100.
    #[serde(default, deserialize_with = "non_null")]
    #[schema(nullable = false, minimum = 0, maximum = 100)]
    pub max_attempts: Option<u32>,
}

impl CreateSubscriptionBody {
    /// Applies the rules of http-api.md §3 and the defaults.
    pub fn validate(self) -> Result<NewSubscription> {
        let name = SubscriptionName::parse(&self.name).ok_or_else(|| {
            Error::invalid_argument("name: must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
        })?;
        let queue_id = QueueId::parse(&self.queue_id).ok_or_else(|| {
            Error::invalid_argument("queue_id: must be 32 lowercase hex characters")
        })?;
        let mut types = Vec::new();
        for (i, t) in self.types.unwrap_or_default().iter().enumerate() {
            types.push(ResultType::parse(t).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "types[{i}]: unknown result type {t:?}; expected task.succeeded, task.failed, task.cancelled or task.needs_review"
                ))
            })?);
        }
        let types = TypeSet::from_list(&types).map_err(Error::invalid_argument)?;
        let max_pending = match self.max_pending.unwrap_or(0) {
            0 => DEFAULT_MAX_PENDING,
            n if n <= MAX_MAX_PENDING => n,
            _ => {
                return Err(Error::invalid_argument(
                    "max_pending: must be 0 (default 100) or 1-1000",
                ));
            }
        };
        let max_attempts = match self.max_attempts.unwrap_or(0) {
            0 => DEFAULT_MAX_ATTEMPTS,
            n if n <= MAX_MAX_ATTEMPTS => n,
            _ => {
                return Err(Error::invalid_argument(
                    "max_attempts: must be 0 (default 20) or 1-100",
                ));
            }
        };
        Ok(NewSubscription {
            name,
            queue_id,
            types,
            from_sequence: self.from_sequence.map(|s| s.0),
            max_pending,
            max_attempts,
        })
    }
}

/// Body of `POST /v1/subscriptions/{id}:configure`: all three required.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ConfigureSubscriptionRequest)]
pub struct ConfigureBody {
    /// Must equal the current revision.
    #[schema(value_type = Uint64String)]
    pub expected_revision: U64Str,
    pub enabled: bool,
    /// Why; kept in the audit record. 1–1024 Unicode scalar values, no NUL.
    #[schema(min_length = 1, max_length = 1024, pattern = r"^[^\u0000]+$")]
    pub reason: String,
}

/// A `reason` (configure, retry): non-empty, at most 1024 Unicode scalar
/// values; NUL is refused because PostgreSQL text cannot store it.
pub fn validate_reason(reason: String) -> Result<String> {
    let n = reason.chars().count();
    if n == 0 || n > MAX_REASON_CHARS {
        return Err(Error::invalid_argument(format!(
            "reason: must be 1 to {MAX_REASON_CHARS} characters"
        )));
    }
    if reason.contains('\0') {
        return Err(Error::invalid_argument("reason: must not contain NUL"));
    }
    Ok(reason)
}

/// The subscription id of a path; 404 when it cannot be one.
pub fn path_subscription_id(id: &str) -> Result<SubscriptionId> {
    SubscriptionId::parse(id).ok_or_else(|| Error::not_found("subscription not found"))
}

/// `POST /v1/subscriptions` (events:manage): 201 `{subscription,
/// deduplicated: false}`; a replay answers 200 with the original snapshot.
#[utoipa::path(
    post,
    path = "/v1/subscriptions",
    tag = "subscriptions",
    operation_id = "createSubscription",
    security(("bearer" = [])),
    params(
        ("Idempotency-Key" = String, Header, pattern = r"^[!-~]{1,255}$",
         description = "1–255 visible ASCII characters, scoped to the credential"),
    ),
    request_body(content = CreateSubscriptionBody, content_type = "application/json"),
    responses(
        (status = 201, description = "Created", body = Envelope<SubscriptionResult>),
        (status = 200, description = "Replay of an earlier request with this key: the original snapshot, `deduplicated: true`", body = Envelope<SubscriptionResult>),
        (status = 404, description = "The queue is unknown or outside the credential's scope", body = crate::http::openapi::ErrorEnvelope),
        (status = 409, description = "STATE_CONFLICT (name taken), SUBSCRIPTION_LIMIT (64 in the namespace) or IDEMPOTENCY_CONFLICT", body = crate::http::openapi::ErrorEnvelope),
        (status = 410, description = "EVENT_HISTORY_EXPIRED: `from_sequence` is below the retention floor; `details.earliest_sequence`", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn create(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsManage)?;
    let key = idempotency_key(&req)?;
    let body: CreateSubscriptionBody = json_body(&req, payload).await?;
    let new = body.validate()?;
    let identity = WriteIdentity::new(
        &principal.credential_id,
        key,
        "subscriptions.create",
        "",
        &new,
    )?;
    let limit = state.settings.limits.max_subscriptions_per_namespace;
    let written = idempotent_write(&req, &state, identity, StatusCode::CREATED, |txn| {
        Box::pin(async move {
            let model = subscriptions::create_subscription(txn, &principal, &new, limit).await?;
            to_data(&SubscriptionResult {
                subscription: SubscriptionView::from(&model),
                deduplicated: false,
            })
        })
    })
    .await?;
    Ok(written.response)
}

/// `GET /v1/subscriptions?queue_id=..[&limit=&cursor=]` (events:read): this
/// credential's subscriptions on the queue, `created_at DESC, id DESC`.
#[utoipa::path(
    get,
    path = "/v1/subscriptions",
    tag = "subscriptions",
    operation_id = "listSubscriptions",
    security(("bearer" = [])),
    params(
        ("queue_id" = String, Query, pattern = "^[0-9a-f]{32}$", description = "The queue (required)"),
        ("limit" = Option<String>, Query, pattern = "^([1-9]|[1-9][0-9]|100)$", description = "Page size 1–100 (default 20), a canonical decimal"),
        ("cursor" = Option<String>, Query, pattern = r"^[A-Za-z0-9_.\-]{1,256}$", description = "`next_cursor` of the previous page, with the same queue"),
    ),
    responses(
        (status = 200, description = "One page", body = Envelope<Page<SubscriptionView>>),
        (status = 404, description = "The queue is outside the credential's scope", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    let params = query_params(&req, &["queue_id", "limit", "cursor"])?;
    let queue_id = params
        .get("queue_id")
        .ok_or_else(|| Error::invalid_argument("queue_id: required query parameter"))?;
    let queue_id = QueueId::parse(queue_id)
        .ok_or_else(|| Error::invalid_argument("queue_id: must be 32 lowercase hex characters"))?;
    let limit = list_limit(params.get("limit").map(String::as_str))?;
    let cursor = params.get("cursor");
    check_cursor_shape(cursor)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    if !principal.in_scope(&queue_id) {
        return Err(Error::not_found("queue not found"));
    }
    let binding = binding(&principal, "subscriptions", queue_id.as_str(), None);
    let after = resume_after(&state, &binding, cursor).await?;
    let page = subscriptions::list_page(
        state.db.reader(),
        &principal,
        &queue_id,
        after.as_ref(),
        limit,
    )
    .await?;
    let next_cursor = next_cursor(
        &state,
        &binding,
        page.more,
        page.items.last().map(|m| ListPosition {
            created_at: m.created_at,
            id: m.id.clone(),
        }),
    )
    .await?;
    Ok(respond(
        &req,
        StatusCode::OK,
        Page {
            items: page.items.iter().map(SubscriptionView::from).collect(),
            next_cursor,
        },
    ))
}

/// `GET /v1/subscriptions/{id}` (events:read): the current state.
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}",
    tag = "subscriptions",
    operation_id = "getSubscription",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "Subscription id")),
    responses(
        (status = 200, description = "The subscription's current state", body = Envelope<SubscriptionView>),
        (status = 404, description = "Unknown, or not this credential's", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn get(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let model = subscriptions::get_owned(state.db.reader(), &principal, &path).await?;
    Ok(respond(
        &req,
        StatusCode::OK,
        SubscriptionView::from(&model),
    ))
}

/// `POST /v1/subscriptions/{id}:configure` (events:manage): pause or
/// resume; bumps `revision` and writes an audit record every time. A resume
/// wakes the scanner after commit.
#[utoipa::path(
    post,
    path = "/v1/subscriptions/{id}:configure",
    tag = "subscriptions",
    operation_id = "configureSubscription",
    security(("bearer" = [])),
    params(
        ("id" = String, Path, description = "Subscription id"),
        ("Idempotency-Key" = String, Header, pattern = r"^[!-~]{1,255}$",
         description = "1–255 visible ASCII characters, scoped to the credential"),
    ),
    request_body(content = ConfigureBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Configured (or a replay: the original snapshot, `deduplicated: true`)", body = Envelope<SubscriptionResult>),
        (status = 404, description = "Unknown, or not this credential's", body = crate::http::openapi::ErrorEnvelope),
        (status = 409, description = "STATE_CONFLICT (`expected_revision` is not the current revision) or IDEMPOTENCY_CONFLICT", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn configure(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsManage)?;
    let key = idempotency_key(&req)?;
    let body: ConfigureBody = json_body(&req, payload).await?;
    let change = Configure {
        expected_revision: body.expected_revision.0,
        enabled: body.enabled,
        reason: validate_reason(body.reason)?,
    };
    let id = path_subscription_id(&path)?;
    let identity = WriteIdentity::new(
        &principal.credential_id,
        key,
        "subscriptions.configure",
        id.as_str(),
        &change,
    )?;
    let target = id.clone();
    let credential_id = principal.credential_id.clone();
    let written = idempotent_write(&req, &state, identity, StatusCode::OK, |txn| {
        Box::pin(async move {
            let model = subscriptions::configure(txn, &principal, &target, &change).await?;
            to_data(&SubscriptionResult {
                subscription: SubscriptionView::from(&model),
                deduplicated: false,
            })
        })
    })
    .await?;
    if written.applied {
        tracing::info!(
            subscription_id = %id,
            %credential_id,
            enabled = body.enabled,
            "subscription {}",
            if body.enabled { "resumed" } else { "paused" }
        );
    }
    if written.applied && body.enabled {
        state.scanner.do_send(SubscriptionChanged {
            subscription_id: id,
            rows_available: true,
        });
    }
    Ok(written.response)
}

/// `GET /v1/subscriptions/{id}/status` (events:read): the queue's head and
/// retention floor, the cursor and lag, the backlog by state, the oldest
/// non-ACKED delivery, the sessions bound on every node, the last pause or
/// resume, and `blocked`: why nothing moves (empty when it moves).
/// Read-only, bounded by `max_pending` rows (decision 0081).
#[utoipa::path(
    get,
    path = "/v1/subscriptions/{id}/status",
    tag = "subscriptions",
    operation_id = "getSubscriptionStatus",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "Subscription id")),
    responses(
        (status = 200, description = "The status", body = Envelope<Status>),
        (status = 404, description = "Unknown, or not this credential's", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn status(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let model = subscriptions::get_owned(state.db.reader(), &principal, &path).await?;
    let status = store::status::read(state.db.reader(), &model).await?;
    Ok(respond(&req, StatusCode::OK, status))
}
