//! The access log: one line per HTTP request (target `orbit_events::access`)
//! and the request metrics, written by the envelope middleware once the
//! answer is known. Decision 0084 says why this is not a middleware crate.

use std::{
    cell::RefCell,
    rc::Rc,
    sync::Arc,
    time::{Duration, Instant},
};

use actix_web::{
    HttpMessage,
    body::BoxBody,
    dev::{ServiceRequest, ServiceResponse},
    http::{Method, StatusCode},
    web,
};

use crate::{
    domain::{CredentialId, DeliveryId, MessageId, SubscriptionId, mask_tokens},
    error::ErrorCode,
    state::AppState,
};

/// The route label of a path no route has: metric labels stay a fixed set.
const UNMATCHED: &str = "unmatched";

/// What the line needs from the request, taken before the handler owns it.
pub struct Access {
    started: Instant,
    request_id: MessageId,
    method: &'static str,
    /// Filled with the route template by the resource that takes the
    /// request.
    route: RouteSlot,
    /// The path as the router matches it, logged when no route matched.
    path: String,
    state: Option<web::Data<AppState>>,
}

/// Where the resource that takes a request writes its route template
/// (`/v1/subscriptions/{id}`), from the guard `http::resource` gives it:
/// the router has matched the path by then, so the line and the metrics
/// need no second routing pass (one took 5 % of the HTTP workers' time at
/// 1,000 publishes/s).
#[derive(Clone, Debug, Default)]
pub struct RouteSlot(Rc<RefCell<Option<Arc<str>>>>);

impl RouteSlot {
    /// Records `template` as the request's route.
    pub fn fill(&self, template: &Arc<str>) {
        *self.0.borrow_mut() = Some(template.clone());
    }
}

impl Access {
    /// Starts timing `req`, answered under `request_id`.
    pub fn begin(req: &ServiceRequest, request_id: &MessageId) -> Access {
        let route = RouteSlot::default();
        req.extensions_mut().insert(route.clone());
        Access {
            started: Instant::now(),
            request_id: request_id.clone(),
            method: method_label(req.method()),
            route,
            path: req.match_info().as_str().to_owned(),
            state: req.app_data::<web::Data<AppState>>().cloned(),
        }
    }

    /// Logs the answer and counts it. Probes and scrapes (`/healthz`,
    /// `/readyz`, `/metrics`) are logged at DEBUG: a line every few seconds
    /// that says nothing would bury the ones that do.
    pub fn finish(self, answer: &Result<ServiceResponse<BoxBody>, actix_web::Error>) {
        let elapsed = self.started.elapsed();
        let (status, code, subscription_id, delivery_id, credential_id) = match answer {
            Ok(res) => {
                let req = res.request();
                let info = req.match_info();
                // Ids only as ids: a path segment is the client's text.
                (
                    res.status(),
                    res.response().extensions().get::<ErrorCode>().copied(),
                    info.get("id")
                        .and_then(SubscriptionId::parse)
                        .map(|id| id.to_string()),
                    info.get("delivery_id")
                        .and_then(DeliveryId::parse)
                        .map(|id| id.to_string()),
                    req.extensions()
                        .get::<CredentialId>()
                        .map(ToString::to_string),
                )
            }
            Err(err) => (
                err.as_response_error().status_code(),
                err.as_error::<crate::error::Error>().map(|e| e.code()),
                None,
                None,
                None,
            ),
        };
        let matched = self.route.0.borrow_mut().take();
        // The path only when no route matched (a 404 worth seeing).
        let path = matched.is_none().then(|| logged_path(&self.path));
        let route = matched.as_deref().unwrap_or(UNMATCHED);
        if let Some(state) = &self.state {
            state
                .metrics
                .http_request(self.method, route, status.as_u16(), elapsed);
        }
        let quiet = matches!(route, "/healthz" | "/readyz" | "/metrics");
        macro_rules! line {
            ($level:expr) => {
                tracing::event!(
                    target: "orbit_events::access",
                    $level,
                    request_id = %self.request_id,
                    method = self.method,
                    route,
                    path = path.as_deref(),
                    status = status.as_u16(),
                    code = code.map(ErrorCode::as_str),
                    duration_ms = millis(elapsed),
                    subscription_id = subscription_id.as_deref(),
                    delivery_id = delivery_id.as_deref(),
                    credential_id = credential_id.as_deref(),
                    "{} {} {}",
                    self.method,
                    path.as_deref().unwrap_or(route),
                    status_text(status),
                )
            };
        }
        if quiet {
            line!(tracing::Level::DEBUG);
        } else {
            line!(tracing::Level::INFO);
        }
    }
}

/// `/v1/subscriptions/{id:[^/:]+}:configure` → `/v1/subscriptions/{id}:configure`.
pub fn template(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut in_regex = false;
    let mut depth = 0u32;
    for c in pattern.chars() {
        match c {
            '{' => {
                depth += 1;
                if depth == 1 {
                    out.push(c);
                }
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    in_regex = false;
                    out.push(c);
                }
            }
            ':' if depth == 1 => in_regex = true,
            _ if in_regex || depth > 1 => {}
            _ => out.push(c),
        }
    }
    out
}

/// A method as a label: the standard ones by name, any other as `OTHER`.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "OTHER",
    }
}

/// A path as logged (percent-decoded, as the router matched it): anything
/// token-shaped (a client's mistake) masked, a long path cut, so a secret
/// never lands in the log by way of a URL.
pub fn logged_path(path: &str) -> String {
    const MAX_CHARS: usize = 200;
    mask_tokens(path).chars().take(MAX_CHARS).collect()
}

fn millis(elapsed: Duration) -> f64 {
    (elapsed.as_secs_f64() * 1e6).round() / 1e3
}

fn status_text(status: StatusCode) -> String {
    match status.canonical_reason() {
        Some(reason) => format!("{} {reason}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_template_drops_the_segment_patterns() {
        assert_eq!(
            template("/v1/subscriptions/{id:[^/:]+}:configure"),
            "/v1/subscriptions/{id}:configure"
        );
        assert_eq!(
            template("/v1/subscriptions/{id:[^/:]+}/deliveries/{delivery_id:[^/:]+}"),
            "/v1/subscriptions/{id}/deliveries/{delivery_id}"
        );
        assert_eq!(template("/docs/{file:.*}"), "/docs/{file}");
        assert_eq!(template("/v1/queues"), "/v1/queues");
    }

    #[test]
    fn a_logged_path_masks_anything_token_shaped_and_is_cut() {
        assert_eq!(logged_path("/v1/xoe_abc/x"), "/v1/xoe_***/x");
        assert_eq!(logged_path(&"/a".repeat(300)).chars().count(), 200);
    }
}
