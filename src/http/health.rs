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

/// 200 `{"status": "ready"}` when the database answers, else 503 `UNAVAILABLE`.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "health",
    operation_id = "readyz",
    responses((status = 200, description = "The database answers", body = crate::http::openapi::Envelope<Health>))
)]
pub async fn readyz(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    no_query(&req)?;
    state.db.ping().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness check: database unreachable");
        Error::unavailable("the database is unreachable")
    })?;
    Ok(respond(
        &req,
        StatusCode::OK,
        Health {
            status: "ready",
            node_id: Some(state.node_id.to_string()),
        },
    ))
}
