//! `/healthz` (the process answers) and `/readyz` (the database answers).

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use serde_json::json;

use crate::{
    error::{Error, Result},
    http::{envelope::respond, request::no_query},
    state::AppState,
};

/// 200 `{"status": "ok"}` while the process serves requests.
pub async fn healthz(req: HttpRequest) -> Result<HttpResponse> {
    no_query(&req)?;
    Ok(respond(&req, StatusCode::OK, json!({ "status": "ok" })))
}

/// 200 `{"status": "ready"}` when the database answers, else 503 `UNAVAILABLE`.
pub async fn readyz(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    no_query(&req)?;
    state.db.ping().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness check: database unreachable");
        Error::unavailable("the database is unreachable")
    })?;
    Ok(respond(
        &req,
        StatusCode::OK,
        json!({ "status": "ready", "node_id": state.node_id }),
    ))
}
