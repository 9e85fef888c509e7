//! The management HTTP API (spec: http-api.md): one module per resource,
//! handlers named after their verbs.

pub mod access_log;
pub mod console;
pub mod deliveries;
pub mod envelope;
pub mod health;
pub mod lists;
pub mod metrics;
pub mod openapi;
pub mod queues;
pub mod reference;
pub mod request;
pub mod results;
pub mod server;
pub mod subscriptions;
pub mod unread_body;
mod write;

use std::sync::Arc;

use actix_web::{HttpResponse, Route, web};

use crate::{error::Error, ws};

/// Registers every route. Unknown routes answer 404 and wrong methods 405
/// (with `Allow`), both before authentication and in the envelope.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(resource(
        "/healthz",
        vec![("GET", web::get().to(health::healthz))],
    ))
    .service(resource(
        "/readyz",
        vec![("GET", web::get().to(health::readyz))],
    ))
    .service(resource(
        "/openapi.json",
        vec![("GET", web::get().to(reference::openapi_json))],
    ))
    .service(resource(
        "/",
        vec![("GET", web::get().to(reference::index))],
    ))
    .service(resource(
        "/docs",
        vec![("GET", web::get().to(reference::docs_root))],
    ))
    .service(resource(
        "/docs/{file:.*}",
        vec![("GET", web::get().to(reference::docs_file))],
    ))
    .service(resource(
        "/console",
        vec![("GET", web::get().to(console::root))],
    ))
    .service(resource(
        "/console/{file:.*}",
        vec![("GET", web::get().to(console::file))],
    ))
    .service(resource(
        "/metrics",
        vec![("GET", web::get().to(metrics::metrics))],
    ))
    .service(resource(
        "/v1/events/connect",
        vec![("GET", web::get().to(ws::upgrade::connect))],
    ))
    .service(resource(
        "/v1/queues",
        vec![("GET", web::get().to(queues::list))],
    ))
    .service(resource(
        "/v1/queues/{queue_id}/results",
        vec![("POST", web::post().to(results::publish))],
    ))
    .service(resource(
        "/v1/subscriptions",
        vec![
            ("GET", web::get().to(subscriptions::list)),
            ("POST", web::post().to(subscriptions::create)),
        ],
    ))
    // A path segment `{id}:verb` names a custom method: ids never hold a
    // colon, so `{id}` and `{id}:configure` cannot be confused.
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}",
        vec![("GET", web::get().to(subscriptions::get))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}:configure",
        vec![("POST", web::post().to(subscriptions::configure))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/status",
        vec![("GET", web::get().to(subscriptions::status))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/deliveries",
        vec![("GET", web::get().to(deliveries::list))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/deliveries:retry",
        vec![("POST", web::post().to(deliveries::bulk_retry))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/deliveries/{delivery_id:[^/:]+}",
        vec![("GET", web::get().to(deliveries::get))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/deliveries/{delivery_id:[^/:]+}/history",
        vec![("GET", web::get().to(deliveries::history))],
    ))
    .service(resource(
        "/v1/subscriptions/{id:[^/:]+}/deliveries/{delivery_id:[^/:]+}:retry",
        vec![("POST", web::post().to(deliveries::retry))],
    ))
    .default_service(web::to(|| async {
        Err::<HttpResponse, _>(Error::not_found("no such route"))
    }));
}

/// A resource whose other methods answer 405 with the right `Allow`.
fn resource(path: &str, routes: Vec<(&'static str, Route)>) -> actix_web::Resource {
    let allow = routes
        .iter()
        .map(|(m, _)| *m)
        .collect::<Vec<_>>()
        .join(", ");
    // A custom method (`{id}:configure`, `deliveries:retry`) is named by a
    // literal colon in the last segment; the router matches the
    // percent-decoded path, where `%3A` is a colon too. (Only the text after
    // the last `{…}` is looked at: a segment's pattern may hold `/` or `:`.)
    let literal_tail = path.rsplit_once('}').map_or(path, |(_, tail)| tail);
    let last_segment = literal_tail
        .rsplit_once('/')
        .map_or(literal_tail, |(_, segment)| segment);
    let suffix = last_segment
        .split_once(':')
        .map(|(_, verb)| format!(":{verb}"));
    let template: Arc<str> = access_log::template(path).into();
    // Passing, the guard makes this resource the request's route: it
    // tells the access log which (`access_log::RouteSlot`).
    let mut res = web::resource(path).guard(actix_web::guard::fn_guard(move |ctx| {
        if let Some(suffix) = &suffix
            && !ctx.head().uri.path().ends_with(suffix.as_str())
        {
            return false;
        }
        if let Some(slot) = ctx.req_data().get::<access_log::RouteSlot>() {
            slot.fill(&template);
        }
        true
    }));
    for (_, route) in routes {
        res = res.route(route);
    }
    res.default_service(web::to(move || {
        let allow = allow.clone();
        async move { Err::<HttpResponse, _>(Error::method_not_allowed(&allow)) }
    }))
}
