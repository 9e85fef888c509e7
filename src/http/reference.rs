//! `GET /openapi.json`: the management API's OpenAPI document, served by
//! the node itself so a client generator or a reader needs no checkout.
//! Public like `/healthz`: it describes routes, never data or secrets.

use actix_web::{HttpRequest, HttpResponse};
use utoipa::{OpenApi, openapi::server::Server};

use crate::{
    error::{Error, Result},
    http::{openapi::ApiDoc, request::no_query},
};

/// The document of `docs/openapi.json`, with `servers` naming this node as
/// the request reached it (`scheme://host[:port]`, honouring `Forwarded`
/// and `X-Forwarded-*` from a proxy in front).
///
/// No authentication; 400 `INVALID_ARGUMENT` for any query parameter.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "health",
    operation_id = "openapi",
    responses(
        (status = 200, description = "This document (OpenAPI 3.1), with `servers` set to the node as the request reached it", content_type = "application/json", body = Object),
    )
)]
pub async fn openapi_json(req: HttpRequest) -> Result<HttpResponse> {
    no_query(&req)?;
    let mut doc = ApiDoc::openapi();
    let origin = {
        let info = req.connection_info();
        format!("{}://{}", info.scheme(), info.host())
    };
    doc.servers = Some(vec![Server::new(origin)]);
    let body = doc.to_pretty_json().map_err(Error::internal)?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(body))
}
