//! `/v1/subscriptions` (spec: http-api.md §3).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::Deserialize;
use serde_json::json;

use crate::{
    auth,
    domain::{Permission, QueueId, ResultType, SubscriptionName, TypeSet, U64Str},
    error::{Error, Result},
    http::{
        envelope::respond,
        request::{idempotency_key, json_body, no_query},
        write::idempotent_write,
    },
    state::AppState,
    store::{
        idempotency::WriteIdentity,
        subscriptions::{self, NewSubscription, SubscriptionView},
    },
    strict_json::non_null,
};

/// Default and range of `max_pending` (0 or omitted → 100; else 1–1000).
const DEFAULT_MAX_PENDING: u32 = 100;
const MAX_MAX_PENDING: u32 = 1000;
/// Default and range of `max_attempts` (0 or omitted → 20; else 1–100).
const DEFAULT_MAX_ATTEMPTS: u32 = 20;
const MAX_MAX_ATTEMPTS: u32 = 100;

/// Body of `POST /v1/subscriptions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSubscriptionBody {
    pub name: String,
    pub queue_id: String,
    #[serde(default, deserialize_with = "non_null")]
    pub types: Option<Vec<String>>,
    /// Omitted or null: start at the committed head.
    #[serde(default)]
    pub from_sequence: Option<U64Str>,
    #[serde(default, deserialize_with = "non_null")]
    pub max_pending: Option<u32>,
    #[serde(default, deserialize_with = "non_null")]
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

/// `POST /v1/subscriptions` (events:manage): 201 `{subscription,
/// deduplicated: false}`; a replay answers 200 with the original snapshot.
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
            Ok(json!({ "subscription": SubscriptionView::from(&model), "deduplicated": false }))
        })
    })
    .await?;
    Ok(written.response)
}

/// `GET /v1/subscriptions/{id}` (events:read): the current state.
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
