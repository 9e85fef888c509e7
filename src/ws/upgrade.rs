//! `GET /v1/events/connect`: the checks before the upgrade, in the order of
//! protocol.md §1, each answered with the HTTP envelope.

use std::sync::{Arc, atomic::AtomicBool};

use actix::Actor;
use actix_web::{FromRequest, HttpRequest, HttpResponse, dev, http::header, web};

use crate::{
    auth::{self, Require},
    delivery::pool::AdmitConnection,
    domain::Permission,
    error::{Error, ErrorCode, Result},
    state::AppState,
    ws::{MAX_MESSAGE_BYTES, SUBPROTOCOL, connection::ConnectionActor, frame_bound::FrameBound},
};

/// Upgrades to `orbit.events.v1` after, in order: no query string (400),
/// Bearer auth (401) with `events:consume` (403), `Origin` in the allow-list
/// when present (403), the subprotocol offered (426 `PROTOCOL_REQUIRED`),
/// and a free node connection slot (429 `CAPACITY_EXCEEDED`,
/// `Retry-After: 1`); a node that is shutting down answers 503
/// `UNAVAILABLE`. No compression extension is negotiated.
pub async fn connect(
    req: HttpRequest,
    body: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse> {
    if !req.query_string().is_empty() {
        return Err(Error::invalid_argument(
            "the connect URL takes no query parameters (tokens belong in the Authorization header)",
        ));
    }
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsConsume)?;
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let allowed = origin
            .to_str()
            .is_ok_and(|o| state.settings.server.allowed_origins.iter().any(|a| a == o));
        if !allowed {
            return Err(Error::permission_denied(
                "this Origin is not allowed to connect",
            ));
        }
    }
    if !offers_subprotocol(&req) {
        return Err(Error::new(
            ErrorCode::ProtocolRequired,
            format!("Sec-WebSocket-Protocol must offer {SUBPROTOCOL}"),
        ));
    }
    if state.shutdown.is_begun() {
        return Err(Error::new(
            ErrorCode::Unavailable,
            "this node is shutting down; connect again (another node, or this one after its restart)",
        ));
    }
    let slot = state
        .pool
        .send(AdmitConnection)
        .await
        .map_err(Error::internal)?
        .map_err(|_| {
            state.metrics.connection_refused();
            Error::capacity_exceeded("this node is at its WebSocket connection limit")
        })?;

    // Frame headers are checked before actix-ws buffers their payload
    // (decision 0077).
    let oversized = Arc::new(AtomicBool::new(false));
    let bounded: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<web::Bytes, actix_web::error::PayloadError>>>,
    > = Box::pin(FrameBound::new(body, MAX_MESSAGE_BYTES, oversized.clone()));
    let body = web::Payload::from_request(&req, &mut dev::Payload::Stream { payload: bounded })
        .await
        .map_err(Error::internal)?;
    let (response, session, stream) =
        actix_ws::handle_with_protocols(&req, body, &[SUBPROTOCOL])
            .map_err(|e| Error::invalid_argument(format!("not a WebSocket upgrade: {e}")))?;
    let stream = stream.max_frame_size(MAX_MESSAGE_BYTES);
    ConnectionActor::new(
        state.get_ref().clone(),
        principal,
        session,
        stream,
        oversized,
        slot,
    )
    .start();
    Ok(response)
}

fn offers_subprotocol(req: &HttpRequest) -> bool {
    req.headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL)
}
