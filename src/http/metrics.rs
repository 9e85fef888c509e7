//! `GET /metrics`: the node's Prometheus metrics in the text format 0.0.4
//! (spec: architecture.md §6). No authentication, like `/healthz`: it holds
//! counts and ids, never a token, secret or payload. Errors are envelopes.

use actix_web::{HttpRequest, HttpResponse, web};

use crate::{
    delivery::pool::GetPoolStats,
    error::{Error, Result},
    http::request::no_query,
    metrics::{CONTENT_TYPE, Operation},
    state::AppState,
    store::backlog,
};

/// The node's Prometheus metrics (text format 0.0.4).
///
/// No authentication. 503 `UNAVAILABLE` when the database does not answer
/// within the management request deadline.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "health",
    operation_id = "metrics",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4 (every metric is described in docs/operations.md)", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String),
        (status = 503, description = "UNAVAILABLE: the database did not answer", body = crate::http::openapi::ErrorEnvelope),
    )
)]
pub async fn metrics(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    no_query(&req)?;
    let deadline = state.settings.timing.http_request_timeout();
    let pool = state
        .pool
        .send(GetPoolStats)
        .await
        .map_err(Error::internal)?;
    let backlog = match tokio::time::timeout(deadline, backlog::read(state.db.reader())).await {
        Ok(Ok(backlog)) => backlog,
        Ok(Err(err)) => {
            state.metrics.database_error(Operation::Metrics);
            return Err(Error::internal(err));
        }
        Err(_) => {
            state.metrics.database_error(Operation::Metrics);
            return Err(Error::unavailable(
                "the database did not answer within the deadline",
            ));
        }
    };
    let text = state
        .metrics
        .encode(&pool.gauges(), &backlog, &state.db.writer_stats())
        .map_err(Error::internal)?;
    Ok(HttpResponse::Ok().content_type(CONTENT_TYPE).body(text))
}
