//! `/healthz` (the process answers) and `/readyz` (the database answers).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};

use crate::{
    error::{Error, Result},
    http::{envelope::respond, request::no_query},
    state::AppState,
};

/// `data` of `/healthz` and `/readyz`.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// `ok` (healthz) or `ready` (readyz).
    pub status: &'static str,
    /// The answering node (readyz only).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::http::openapi::Id>, nullable = false)]
    pub node_id: Option<String>,
}

/// 200 `{"status": "ok"}` while the process serves requests.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "health",
    operation_id = "healthz",
    responses((status = 200, description = "The process serves requests", body = crate::http::openapi::Envelope<Health>))
)]
pub async fn healthz(req: HttpRequest) -> Result<HttpResponse> {
    no_query(&req)?;
    Ok(respond(
        &req,
        StatusCode::OK,
        Health {
            status: "ok",
            node_id: None,
        },
    ))
}

/// How long `/readyz` waits for the database to answer (a load balancer's
/// health check should not wait for the 8 s request deadline).
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// How often `/readyz` tries a write while the database refuses writes.
const WRITE_PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// 200 `{"status": "ready"}` when the database answers and accepts writes,
/// else 503 `UNAVAILABLE`. Writes are judged by the writer's last outcome:
/// after a fault (a full disk, a lost connection) `/readyz` answers 503
/// until a write commits again, and finds that out itself with one small
/// write transaction at most every second (decision 0076).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "health",
    operation_id = "readyz",
    responses(
        (status = 200, description = "The database answers and accepts writes", body = crate::http::openapi::Envelope<Health>),
        (status = 503, description = "The database is unreachable or refuses writes (`UNAVAILABLE`)", body = crate::http::openapi::ErrorEnvelope)
    )
)]
pub async fn readyz(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    no_query(&req)?;
    match tokio::time::timeout(PING_TIMEOUT, state.db.ping()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            crate::store::writer::log_failure(&e, "readiness check: database unreachable");
            return Err(Error::unavailable("the database is unreachable"));
        }
        Err(_) => {
            return Err(Error::unavailable("the database did not answer within 2 s"));
        }
    }
    let node = state.node_id.to_string();
    if !state.db.writes_accepted(&node, WRITE_PROBE_EVERY).await {
        return Err(Error::unavailable("the database refuses writes"));
    }
    Ok(respond(
        &req,
        StatusCode::OK,
        Health {
            status: "ready",
            node_id: Some(state.node_id.to_string()),
        },
    ))
}
