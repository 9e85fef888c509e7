//! `GET /openapi.json`, the management API's OpenAPI document, and `GET
//! /docs/`, a reference page over it, served by the node itself so a
//! client generator or a reader needs no checkout and no internet. Public
//! like `/healthz`: they describe routes, never data or secrets.

use std::sync::{Arc, OnceLock};

use actix_web::{HttpRequest, HttpResponse, http::header, web};
use utoipa::{OpenApi, openapi::server::Server};
use utoipa_swagger_ui::Config;

use crate::{
    error::{Error, Result},
    http::{openapi::ApiDoc, request::no_query},
};

/// The document of `docs/openapi.json`, with `servers` naming this node as
/// the request reached it (`scheme://host[:port][prefix]`, honouring
/// `Forwarded`, `X-Forwarded-*` and `X-Forwarded-Prefix` from a proxy in
/// front).
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
    // A proxy that mounts the node under a path says so in
    // `X-Forwarded-Prefix`; only a plain path is taken.
    let prefix = req
        .headers()
        .get("x-forwarded-prefix")
        .and_then(|v| v.to_str().ok())
        .map(|p| p.trim_end_matches('/'))
        .filter(|p| {
            p.starts_with('/')
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"/-._~".contains(&b))
        })
        .unwrap_or("");
    let origin = {
        let info = req.connection_info();
        format!("{}://{}{prefix}", info.scheme(), info.host())
    };
    doc.servers = Some(vec![Server::new(origin)]);
    let body = doc.to_pretty_json().map_err(Error::internal)?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(body))
}

/// Swagger UI's settings: the document of this node, and no validator (its
/// default badge would fetch an image from another host).
fn swagger_config() -> Arc<Config<'static>> {
    static CONFIG: OnceLock<Arc<Config<'static>>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            // Relative to `/docs/`: the page works behind a proxy that
            // mounts the node under a path prefix.
            Arc::new(Config::from("../openapi.json").validator_url("none"))
        })
        .clone()
}

/// `GET /docs`: redirects (308) to `/docs/`, where the page's relative
/// links resolve.
pub async fn docs_root(req: HttpRequest) -> Result<HttpResponse> {
    no_query(&req)?;
    Ok(HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "docs/"))
        .finish())
}

/// `GET /`: a person opening the node in a browser lands on the reference.
pub async fn index(req: HttpRequest) -> Result<HttpResponse> {
    no_query(&req)?;
    Ok(HttpResponse::TemporaryRedirect()
        .insert_header((header::LOCATION, "docs/"))
        .finish())
}

/// `GET /docs/{file}`: the API reference page (Swagger UI over
/// `/openapi.json`), every file embedded in the binary, so it works with no
/// internet; 404 `NOT_FOUND` for a file it does not have. No
/// authentication; the page asks for a token only to try a request out.
pub async fn docs_file(req: HttpRequest, file: web::Path<String>) -> Result<HttpResponse> {
    no_query(&req)?;
    let file = utoipa_swagger_ui::serve(&file, swagger_config())
        .map_err(|e| Error::internal(format_args!("API reference page: {e}")))?
        .ok_or_else(|| Error::not_found("no such file of the API reference page"))?;
    let mut res = HttpResponse::Ok();
    if file.gzpipped {
        res.insert_header(header::ContentEncoding::Gzip);
    }
    Ok(res
        .content_type(file.content_type)
        .body(file.bytes.into_owned()))
}
