//! `POST /v1/queues/{queue_id}/results`: the producer side of the result
//! log (spec: http-api.md §3 "Result ingest", delivery-model.md §3).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use crate::{
    auth::{self, Require},
    domain::{Permission, QueueId, ResultType, Timestamp, U64Str, is_id},
    error::{Error, Result},
    http::{
        envelope::{request_commitment, respond},
        openapi::{
            Envelope, ErrorEnvelope, Id, JsonObject, ResultTypeName, SnapshotState, Time,
            Uint64String,
        },
        request::{idempotency_key, json_body, no_query},
    },
    journal::NewResult,
    state::AppState,
    store::{
        idempotency::WriteIdentity,
        publish::{PublishRequest, PublishResult, Published},
    },
    strict_json::{self, non_null},
};

/// Results per request.
pub const MAX_RESULTS_PER_REQUEST: usize = 100;

/// Body: `{"results": [1..100 results]}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = PublishResultsRequest)]
pub struct PublishBody {
    /// Appended atomically, in this order.
    #[schema(min_items = 1, max_items = 100)]
    pub results: Vec<PublishedResult>,
}

/// One result as a producer sends it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishedResult {
    #[serde(rename = "type")]
    #[schema(value_type = ResultTypeName)]
    pub result_type: String,
    /// The task id; equals `snapshot.task_id`.
    #[schema(value_type = Id)]
    pub aggregate_id: String,
    /// Equals `snapshot.revision`.
    #[schema(value_type = Uint64String)]
    pub aggregate_revision: U64Str,
    /// RFC 3339, at most microsecond precision.
    #[schema(value_type = Time)]
    pub occurred_at: String,
    /// Any JSON object, kept byte-exact.
    #[schema(value_type = JsonObject)]
    pub details: Box<RawValue>,
    #[schema(value_type = ResultSnapshot)]
    pub snapshot: Box<RawValue>,
}

/// The task snapshot of a result (schema_version 1); `result` is arbitrary
/// JSON kept byte-exact in the stored snapshot text.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResultSnapshot {
    /// Always 1.
    #[schema(minimum = 1, maximum = 1)]
    schema_version: u32,
    /// Equals `aggregate_id`.
    #[schema(value_type = Id)]
    task_id: String,
    /// Equals the queue in the path.
    #[schema(value_type = Id)]
    queue_id: String,
    /// SUCCEEDED, FAILED, CANCELLED or NEEDS_REVIEW, matching the type.
    #[schema(value_type = SnapshotState)]
    state: String,
    /// Equals `aggregate_revision`.
    #[schema(value_type = Uint64String)]
    revision: U64Str,
    effect_uncertain: bool,
    /// Any JSON value (numbers keep their full precision).
    #[serde(default)]
    #[allow(dead_code)]
    #[schema(value_type = Option<serde_json::Value>)]
    result: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "non_null")]
    #[schema(value_type = Option<Id>, nullable = false)]
    current_attempt_id: Option<String>,
}

/// The normalized form of one result, for the idempotency digest.
#[derive(Serialize)]
pub(crate) struct NormalizedResult {
    result_type: &'static str,
    aggregate_id: String,
    aggregate_revision: String,
    occurred_at: i64,
    details: String,
    snapshot: String,
}

fn validate(
    queue_id: &QueueId,
    body: PublishBody,
) -> Result<(Vec<NewResult>, Vec<NormalizedResult>)> {
    if body.results.is_empty() || body.results.len() > MAX_RESULTS_PER_REQUEST {
        return Err(Error::invalid_argument(format!(
            "results: must hold 1 to {MAX_RESULTS_PER_REQUEST} results"
        )));
    }
    let mut out = Vec::with_capacity(body.results.len());
    let mut normalized = Vec::with_capacity(body.results.len());
    for (i, r) in body.results.into_iter().enumerate() {
        let (result, norm) = validate_result(queue_id, &format!("results[{i}]"), r)?;
        out.push(result);
        normalized.push(norm);
    }
    Ok((out, normalized))
}

/// One result checked against the rules of result ingest (http-api.md §3)
/// for `queue_id`; errors are 400 `INVALID_ARGUMENT` naming the field as
/// `{label}.{field}`. Shared with the transactional outbox
/// ([`crate::outbox`]).
pub(crate) fn validate_result(
    queue_id: &QueueId,
    label: &str,
    r: PublishedResult,
) -> Result<(NewResult, NormalizedResult)> {
    let at = |field: &str, msg: &str| Error::invalid_argument(format!("{label}.{field}: {msg}"));
    let result_type = ResultType::parse(&r.result_type).ok_or_else(|| {
        at(
            "type",
            "must be task.succeeded, task.failed, task.cancelled or task.needs_review",
        )
    })?;
    if !is_id(&r.aggregate_id) {
        return Err(at("aggregate_id", "must be 32 lowercase hex characters"));
    }
    let occurred_at = Timestamp::parse_rfc3339(&r.occurred_at).map_err(|m| at("occurred_at", m))?;
    if !r.details.get().starts_with('{') {
        return Err(at("details", "must be a JSON object"));
    }
    if !r.snapshot.get().starts_with('{') {
        return Err(at("snapshot", "must be a JSON object"));
    }
    let snap: ResultSnapshot =
        strict_json::parse_checked(r.snapshot.get().as_bytes()).map_err(|e| {
            let field = if e.path == "." {
                "snapshot".to_owned()
            } else {
                format!("snapshot.{}", e.path)
            };
            at(&field, &e.message)
        })?;
    if snap.schema_version != 1 {
        return Err(at("snapshot.schema_version", "must be 1"));
    }
    if snap.task_id != r.aggregate_id {
        return Err(at("snapshot.task_id", "must equal aggregate_id"));
    }
    if snap.queue_id != queue_id.as_str() {
        return Err(at("snapshot.queue_id", "must equal the queue in the path"));
    }
    if snap.revision != r.aggregate_revision {
        return Err(at("snapshot.revision", "must equal aggregate_revision"));
    }
    if snap.state != result_type.snapshot_state().as_str() {
        return Err(at(
            "snapshot.state",
            &format!(
                "must be {} for {}",
                result_type.snapshot_state().as_str(),
                result_type
            ),
        ));
    }
    if snap
        .current_attempt_id
        .as_deref()
        .is_some_and(|a| !is_id(a))
    {
        return Err(at(
            "snapshot.current_attempt_id",
            "must be 32 lowercase hex characters",
        ));
    }
    let _ = snap.effect_uncertain;
    let normalized = NormalizedResult {
        result_type: result_type.as_str(),
        aggregate_id: r.aggregate_id.clone(),
        aggregate_revision: r.aggregate_revision.to_string(),
        occurred_at: occurred_at.micros(),
        details: strict_json::canonical(&r.details)?,
        snapshot: strict_json::canonical(&r.snapshot)?,
    };
    let result = NewResult {
        result_type,
        aggregate_id: r.aggregate_id,
        aggregate_revision: r.aggregate_revision.to_string(),
        occurred_at,
        details: r.details.get().to_owned(),
        snapshot: r.snapshot.get().to_owned(),
    };
    Ok((result, normalized))
}

/// `POST /v1/queues/{queue_id}/results` (results:publish): appends the whole
/// batch atomically; 201 `{events: [{id, sequence}], deduplicated: false}`.
/// The scanner is woken after the commit.
#[utoipa::path(
    post,
    path = "/v1/queues/{queue_id}/results",
    tag = "results",
    operation_id = "publishResults",
    security(("bearer" = [])),
    params(
        ("queue_id" = String, Path, description = "The queue whose log the results join"),
        ("Idempotency-Key" = String, Header, pattern = r"^[!-~]{1,255}$",
         description = "1–255 visible ASCII characters, scoped to the credential"),
    ),
    request_body(content = PublishBody, content_type = "application/json"),
    responses(
        (status = 201, description = "Appended", body = Envelope<PublishResult>),
        (status = 200, description = "Replay of an earlier request with this key, `deduplicated: true`", body = Envelope<PublishResult>),
        (status = 404, description = "The queue is unknown or outside the credential's scope", body = ErrorEnvelope),
        (status = 409, description = "IDEMPOTENCY_CONFLICT", body = ErrorEnvelope),
    )
)]
pub async fn publish(
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::ResultsPublish)?;
    let key = idempotency_key(&req)?;
    let body: PublishBody = json_body(&req, payload).await?;
    let queue_id = QueueId::parse(&path).ok_or_else(|| Error::not_found("queue not found"))?;
    let (results, normalized) = validate(&queue_id, body)?;
    if !principal.in_scope(&queue_id) {
        return Err(Error::not_found("queue not found"));
    }
    let identity = WriteIdentity::new(
        &principal.credential_id,
        key,
        "results.publish",
        queue_id.as_str(),
        &normalized,
    )?;
    // Decides, with the request's deadline, whether the batch writes it.
    let commitment = request_commitment(&req);
    let request = PublishRequest {
        identity,
        queue_id: queue_id.clone(),
        results,
        commitment,
    };
    // A group commit (decision 0078); answered after the commit.
    let outcome = state.writes.publish(request).await?;
    match outcome {
        Published::Fresh(data) => Ok(respond(&req, StatusCode::CREATED, data)),
        Published::Replay(data) => Ok(respond(&req, StatusCode::OK, data)),
    }
}
