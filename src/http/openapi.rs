//! The OpenAPI 3.1 description of the management API, generated from the
//! handlers' `#[utoipa::path]` attributes and the wire types' `ToSchema`
//! derives (spec: http-api.md §4, last paragraph). `docs/openapi.json` is
//! this document, pretty-printed; a test fails when the two differ
//! (regenerate with `ORBIT_UPDATE_OPENAPI=1 cargo test --test api openapi`).
//!
//! The WebSocket endpoint `GET /v1/events/connect` is not in the document:
//! OpenAPI has no way to state a frame protocol (`orbit.events.v1` has its
//! own description).

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::{
    Modify, OpenApi, PartialSchema, ToSchema,
    openapi::{
        self, HttpMethod, ObjectBuilder, RefOr, Response, Type,
        header::HeaderBuilder,
        path::Operation,
        schema::Schema,
        security::{HttpAuthScheme, HttpBuilder, SecurityScheme},
    },
};

pub use crate::domain::schema::*;
use crate::{
    error::ErrorCode,
    http::{deliveries, health, metrics, queues, reference, results, subscriptions},
    store::{deliveries::DeliveryView, subscriptions::SubscriptionView},
};

/// The document, pretty-printed as committed in `docs/openapi.json`
/// (with a trailing newline).
pub fn document() -> String {
    let text = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    format!("{text}\n")
}

/// The OpenAPI description of the management API.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "orbit-events management API",
        version = "1",
        description = "Subscriptions, deliveries and result ingest of orbit-events. \
Every response is an envelope: `{request_id, data}` on success, `{request_id, error}` \
otherwise, with `X-Request-ID`, `Cache-Control: no-store` and `Content-Type: application/json`. \
Every POST takes an `Idempotency-Key`. The WebSocket endpoint `GET /v1/events/connect` \
speaks the `orbit.events.v1` frame protocol, which is described separately.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    paths(
        subscriptions::create,
        subscriptions::list,
        subscriptions::get,
        subscriptions::configure,
        subscriptions::status,
        deliveries::list,
        deliveries::get,
        deliveries::history,
        deliveries::retry,
        deliveries::bulk_retry,
        queues::list,
        results::publish,
        health::healthz,
        health::readyz,
        metrics::metrics,
        reference::openapi_json,
    ),
    components(schemas(ErrorEnvelope, ErrorBody, ErrorCodeName)),
    modifiers(&Common),
    tags(
        (name = "subscriptions", description = "Create, list, read and pause/resume subscriptions"),
        (name = "deliveries", description = "Inspect deliveries and re-arm EXPIRED ones"),
        (name = "queues", description = "The queues of the credential's scope"),
        (name = "results", description = "Append task results to a queue's result log"),
        (name = "health", description = "Liveness, readiness and Prometheus metrics (no authentication)"),
    )
)]
pub struct ApiDoc;

/// The codes an HTTP management request can answer with (the upgrade-only
/// and frame-only codes belong to the WebSocket protocol).
const HTTP_ERROR_CODES: [ErrorCode; 9] = [
    ErrorCode::InvalidArgument,
    ErrorCode::Unauthenticated,
    ErrorCode::PermissionDenied,
    ErrorCode::NotFound,
    ErrorCode::StateConflict,
    ErrorCode::IdempotencyConflict,
    ErrorCode::SubscriptionLimit,
    ErrorCode::EventHistoryExpired,
    ErrorCode::Unavailable,
];

macro_rules! string_schema {
    ($(#[$doc:meta])* $name:ident, $build:expr) => {
        $(#[$doc])*
        pub struct $name;
        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                let b: ObjectBuilder = $build;
                b.into()
            }
        }
        impl ToSchema for $name {}
    };
}

string_schema!(
    /// A machine-readable error code (http-api.md §4).
    ErrorCodeName,
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(HTTP_ERROR_CODES.iter().map(|c| c.as_str())))
);

/// The success envelope.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Envelope<T: ToSchema> {
    #[schema(value_type = Id)]
    pub request_id: String,
    pub data: T,
}

/// The error envelope.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorEnvelope {
    #[schema(value_type = Id)]
    pub request_id: String,
    pub error: ErrorBody,
}

/// `error` of the error envelope.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    #[schema(value_type = ErrorCodeName)]
    pub code: String,
    /// Human-readable; names the offending field where there is one.
    pub message: String,
    /// `EVENT_HISTORY_EXPIRED`: `{"earliest_sequence": "<uint64>"}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<JsonObject>, nullable = false)]
    pub details: Option<serde_json::Value>,
}

/// `data` of a subscription write: the subscription as the write left it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionResult {
    pub subscription: SubscriptionView,
    /// True when this answer replays an earlier request with the same key.
    pub deduplicated: bool,
}

/// `data` of a delivery retry: the delivery as the retry left it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveryResult {
    pub delivery: DeliveryView,
    /// True when this answer replays an earlier request with the same key.
    pub deduplicated: bool,
}

/// A page of a list, newest first.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Page<T: ToSchema> {
    pub items: Vec<T>,
    /// Present when more items follow; pass it as `cursor` for the next
    /// page (with the same filters).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub next_cursor: Option<String>,
}

/// A result event as delivered (`event` of `event.deliver` and of the
/// delivery detail). Documentation only: the server renders it in
/// `journal::RenderedEvent`; the API tests validate it against this schema.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct ResultEvent {
    #[schema(value_type = Id)]
    id: String,
    #[schema(value_type = Uint64String)]
    sequence: String,
    #[serde(rename = "type")]
    #[schema(value_type = ResultTypeName)]
    event_type: String,
    /// Always `task`.
    aggregate_kind: String,
    #[schema(value_type = Id)]
    aggregate_id: String,
    #[schema(value_type = Uint64String)]
    aggregate_revision: String,
    #[schema(value_type = Time)]
    occurred_at: String,
    #[schema(value_type = JsonObject)]
    details: String,
    #[schema(value_type = results::ResultSnapshot)]
    snapshot: String,
}

/// `data` of the delivery detail.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct DeliveryDetail {
    delivery: DeliveryView,
    event: ResultEvent,
}

/// Fills in what every operation shares: the bearer scheme, the common
/// response headers, and the error responses every endpoint can give.
struct Common;

impl Modify for Common {
    fn modify(&self, doc: &mut openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("A credential token from `orbit-events bootstrap`."))
                    .build(),
            ),
        );
        for (path, item) in doc.paths.paths.iter_mut() {
            let public = path.starts_with("/healthz")
                || path.starts_with("/readyz")
                || path.starts_with("/metrics");
            for (method, op) in operations(item) {
                let mut errors: BTreeMap<&str, &str> = BTreeMap::new();
                errors.insert(
                    "400",
                    "Invalid argument (query string, header or body; the message names the field)",
                );
                errors.insert("503", "Unavailable: the database is unreachable or the 8 s deadline passed (the transaction was rolled back)");
                if !public {
                    errors.insert("401", "Missing, malformed, unknown or revoked bearer token");
                    errors.insert("403", "The credential lacks the permission");
                }
                if method == HttpMethod::Post {
                    errors.insert(
                        "413",
                        "The body exceeds 524288 bytes (code INVALID_ARGUMENT)",
                    );
                }
                for (status, description) in errors {
                    op.responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| error_response(description).into());
                }
                for (status, response) in op.responses.responses.iter_mut() {
                    if let RefOr::T(response) = response {
                        add_common_headers(response, status);
                    }
                }
            }
        }
    }
}

/// An error response with the envelope schema.
pub fn error_response(description: &str) -> Response {
    openapi::ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            openapi::ContentBuilder::new()
                .schema(Some(RefOr::Ref(openapi::Ref::from_schema_name(
                    "ErrorEnvelope",
                ))))
                .build(),
        )
        .build()
}

fn add_common_headers(response: &mut Response, status: &str) {
    let string_header = |description: &str, pattern: Option<&str>| {
        let mut schema = ObjectBuilder::new().schema_type(Type::String);
        if let Some(p) = pattern {
            schema = schema.pattern(Some(p));
        }
        RefOr::T(
            HeaderBuilder::new()
                .schema(Some(schema))
                .description(Some(description))
                .build(),
        )
    };
    response.headers.insert(
        "X-Request-ID".to_owned(),
        string_header("Equals the envelope's `request_id`.", Some(ID_PATTERN)),
    );
    response.headers.insert(
        "Cache-Control".to_owned(),
        string_header("Always `no-store`.", Some("^no-store$")),
    );
    if status == "401" {
        response.headers.insert(
            "WWW-Authenticate".to_owned(),
            string_header("`Bearer`.", Some("^Bearer")),
        );
    }
}

fn operations(item: &mut openapi::PathItem) -> Vec<(HttpMethod, &mut Operation)> {
    let mut out = Vec::new();
    if let Some(op) = item.get.as_mut() {
        out.push((HttpMethod::Get, op));
    }
    if let Some(op) = item.post.as_mut() {
        out.push((HttpMethod::Post, op));
    }
    out
}
