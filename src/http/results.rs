//! `POST /v1/queues/{queue_id}/results`: the producer side of the result
//! log (spec: http-api.md §3 "Result ingest", delivery-model.md §3).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde::{Deserialize, Serialize};
use serde_json::{json, value::RawValue};

use crate::{
    auth,
    delivery::scanner::JournalAppended,
    domain::{Permission, QueueId, ResultType, Timestamp, U64Str, is_id, now},
    error::{Error, Result},
    http::{
        request::{idempotency_key, json_body, no_query},
        write::idempotent_write,
    },
    journal::{self, NewResult},
    state::AppState,
    store::idempotency::WriteIdentity,
    strict_json::{self, non_null},
};

/// Results per request.
pub const MAX_RESULTS_PER_REQUEST: usize = 100;

/// Body: `{"results": [1..100 results]}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishBody {
    pub results: Vec<PublishedResult>,
}

/// One result as a producer sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishedResult {
    #[serde(rename = "type")]
    pub result_type: String,
    pub aggregate_id: String,
    pub aggregate_revision: U64Str,
    pub occurred_at: String,
    pub details: Box<RawValue>,
    pub snapshot: Box<RawValue>,
}

/// The fixed snapshot shape (schema_version 1); `result` is arbitrary JSON
/// kept byte-exact in the stored snapshot text.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Snapshot {
    schema_version: u32,
    task_id: String,
    queue_id: String,
    state: String,
    revision: U64Str,
    effect_uncertain: bool,
    #[serde(default)]
    #[allow(dead_code)]
    result: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "non_null")]
    current_attempt_id: Option<String>,
}

/// The normalized form of one result, for the idempotency digest.
#[derive(Serialize)]
struct NormalizedResult {
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
        let at = |field: &str, msg: &str| {
            Error::invalid_argument(format!("results[{i}].{field}: {msg}"))
        };
        let result_type = ResultType::parse(&r.result_type).ok_or_else(|| {
            at(
                "type",
                "must be task.succeeded, task.failed, task.cancelled or task.needs_review",
            )
        })?;
        if !is_id(&r.aggregate_id) {
            return Err(at("aggregate_id", "must be 32 lowercase hex characters"));
        }
        let occurred_at =
            Timestamp::parse_rfc3339(&r.occurred_at).map_err(|m| at("occurred_at", m))?;
        if !r.details.get().starts_with('{') {
            return Err(at("details", "must be a JSON object"));
        }
        if !r.snapshot.get().starts_with('{') {
            return Err(at("snapshot", "must be a JSON object"));
        }
        let snap: Snapshot =
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
        if snap.state != result_type.snapshot_state() {
            return Err(at(
                "snapshot.state",
                &format!(
                    "must be {} for {}",
                    result_type.snapshot_state(),
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
        normalized.push(NormalizedResult {
            result_type: result_type.as_str(),
            aggregate_id: r.aggregate_id.clone(),
            aggregate_revision: r.aggregate_revision.to_string(),
            occurred_at: occurred_at.micros(),
            details: strict_json::canonical(&r.details)?,
            snapshot: strict_json::canonical(&r.snapshot)?,
        });
        out.push(NewResult {
            result_type,
            aggregate_id: r.aggregate_id,
            aggregate_revision: r.aggregate_revision.to_string(),
            occurred_at,
            details: r.details.get().to_owned(),
            snapshot: r.snapshot.get().to_owned(),
        });
    }
    Ok((out, normalized))
}

/// `POST /v1/queues/{queue_id}/results` (results:publish): appends the whole
/// batch atomically; 201 `{events: [{id, sequence}], deduplicated: false}`.
/// The scanner is woken after the commit.
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
    let q = queue_id.clone();
    let written = idempotent_write(&req, &state, identity, StatusCode::CREATED, |txn| {
        Box::pin(async move {
            let appended = journal::append(txn, &q, &results, now())
                .await?
                .ok_or_else(|| Error::not_found("queue not found"))?;
            let events: Vec<_> = appended
                .iter()
                .map(|(id, seq)| json!({ "id": id, "sequence": seq.to_string() }))
                .collect();
            Ok(json!({ "events": events, "deduplicated": false }))
        })
    })
    .await?;
    if written.applied {
        state.scanner.do_send(JournalAppended { queue_id });
    }
    Ok(written.response)
}
