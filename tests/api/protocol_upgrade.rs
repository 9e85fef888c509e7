//! protocol.md §1: the checks before the upgrade, in their order, each
//! answered with the HTTP envelope.

use tokio_tungstenite::tungstenite::{
    client::IntoClientRequest,
    http::{HeaderName, HeaderValue},
};

use crate::{helpers::*, protocol_support::*};

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// A WebSocket upgrade request over plain HTTP with `headers` (the
/// upgrade headers are added), for refusals answered before the upgrade.
async fn upgrade(app: &TestApp, query: &str, headers: &[(&str, &str)]) -> Resp {
    let mut req = app
        .http
        .get(format!("{}/v1/events/connect{query}", app.address))
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .header("Sec-WebSocket-Version", "13")
        .header("Sec-WebSocket-Key", KEY);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = req.send().await.unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = serde_json::from_str(&res.text().await.unwrap()).unwrap_or_default();
    let resp = Resp {
        status,
        headers,
        body,
    };
    assert!(
        resp.headers.contains_key("x-request-id"),
        "envelope headers"
    );
    assert_eq!(resp.headers["cache-control"], "no-store");
    resp
}

/// Connects with the WebSocket client; returns the handshake response or
/// the refusal's status.
async fn ws_connect(
    app: &TestApp,
    headers: &[(&str, &str)],
) -> Result<
    (
        tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    u16,
> {
    let mut req = app.ws_url().into_client_request().unwrap();
    for (name, value) in headers {
        req.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok(ok) => Ok(ok),
        Err(tokio_tungstenite::tungstenite::Error::Http(res)) => Err(res.status().as_u16()),
        Err(other) => panic!("handshake failed: {other}"),
    }
}

fn bearer(cred: &Cred) -> String {
    format!("Bearer {}", cred.token)
}

#[actix_web::test]
async fn a_query_string_on_the_connect_url_is_refused_with_400_even_before_authentication() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let proto = ("Sec-WebSocket-Protocol", "orbit.events.v1");
    upgrade(&app, &format!("?token={}", cred.token), &[proto])
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    let auth = bearer(&cred);
    upgrade(&app, "?x=1", &[proto, ("Authorization", &auth)])
        .await
        .assert_error(400, "INVALID_ARGUMENT");
}

#[actix_web::test]
async fn an_upgrade_without_a_valid_bearer_token_is_refused_with_401_and_cookies_are_ignored() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let proto = ("Sec-WebSocket-Protocol", "orbit.events.v1");
    let res = upgrade(&app, "", &[proto]).await;
    res.assert_error(401, "UNAUTHENTICATED");
    assert_eq!(res.headers["www-authenticate"], "Bearer");
    upgrade(&app, "", &[proto, ("Authorization", "Bearer oe_nope")])
        .await
        .assert_error(401, "UNAUTHENTICATED");
    upgrade(&app, "", &[proto, ("Authorization", &cred.token)])
        .await
        .assert_error(401, "UNAUTHENTICATED");
    let cookie = format!("token={0}; authorization=Bearer {0}", cred.token);
    upgrade(&app, "", &[proto, ("Cookie", &cookie)])
        .await
        .assert_error(401, "UNAUTHENTICATED");

    orbit_events::store::tenancy::revoke_credential(
        &app.db,
        &orbit_events::domain::CredentialId::parse(&cred.credential_id).unwrap(),
    )
    .await
    .unwrap();
    upgrade(&app, "", &[proto, ("Authorization", &bearer(&cred))])
        .await
        .assert_error(401, "UNAUTHENTICATED");
}

#[actix_web::test]
async fn an_upgrade_without_the_events_consume_permission_is_refused_with_403() {
    let app = spawn_app().await;
    let publisher = app.bootstrap_with("demo", "app", "q1", false, true).await;
    let res = upgrade(
        &app,
        "",
        &[
            ("Sec-WebSocket-Protocol", "orbit.events.v1"),
            ("Authorization", &bearer(&publisher)),
        ],
    )
    .await;
    res.assert_error(403, "PERMISSION_DENIED");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("events:consume")
    );
}

#[actix_web::test]
async fn an_origin_outside_the_allow_list_is_refused_with_403_and_the_list_is_empty_by_default() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let auth = bearer(&cred);
    let headers = |origin: &'static str| {
        [
            ("Sec-WebSocket-Protocol", "orbit.events.v1"),
            ("Authorization", auth.as_str()),
            ("Origin", origin),
        ]
    };
    upgrade(&app, "", &headers("https://app.example"))
        .await
        .assert_error(403, "PERMISSION_DENIED");

    let app =
        spawn_app_with(|s| s.server.allowed_origins = vec!["https://app.example".into()]).await;
    let cred = app.bootstrap().await;
    let auth = bearer(&cred);
    let allowed = [
        ("Sec-WebSocket-Protocol", "orbit.events.v1"),
        ("Authorization", auth.as_str()),
        ("Origin", "https://app.example"),
    ];
    assert!(ws_connect(&app, &allowed).await.is_ok());
    let other = [
        ("Sec-WebSocket-Protocol", "orbit.events.v1"),
        ("Authorization", auth.as_str()),
        ("Origin", "https://evil.example"),
    ];
    upgrade(&app, "", &other)
        .await
        .assert_error(403, "PERMISSION_DENIED");
    // Without an Origin (a non-browser client) the allow-list does not apply.
    assert!(
        ws_connect(&app, &allowed[..2]).await.is_ok(),
        "no Origin header"
    );
}

#[actix_web::test]
async fn an_upgrade_that_does_not_offer_orbit_events_v1_is_refused_with_426_protocol_required() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let auth = bearer(&cred);
    upgrade(&app, "", &[("Authorization", &auth)])
        .await
        .assert_error(426, "PROTOCOL_REQUIRED");
    upgrade(
        &app,
        "",
        &[
            ("Authorization", &auth),
            ("Sec-WebSocket-Protocol", "orbit.events.v2, chat"),
        ],
    )
    .await
    .assert_error(426, "PROTOCOL_REQUIRED");
}

#[actix_web::test]
async fn the_upgrade_reply_selects_exactly_orbit_events_v1_and_negotiates_no_compression() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let auth = bearer(&cred);
    let (_ws, res) = ws_connect(
        &app,
        &[
            ("Authorization", &auth),
            ("Sec-WebSocket-Protocol", "chat, orbit.events.v1"),
            ("Sec-WebSocket-Extensions", "permessage-deflate"),
        ],
    )
    .await
    .expect("upgraded");
    assert_eq!(res.status(), 101);
    assert_eq!(res.headers()["sec-websocket-protocol"], "orbit.events.v1");
    assert!(
        res.headers().get("sec-websocket-extensions").is_none(),
        "no extension is negotiated"
    );
}

#[actix_web::test]
async fn the_upgrade_over_the_node_connection_limit_gets_429_capacity_exceeded_with_retry_after_1()
{
    let app = spawn_app_with(|s| s.limits.max_connections = 2).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let auth = bearer(&cred);
    let proto = ("Sec-WebSocket-Protocol", "orbit.events.v1");
    // One bound session and one connection still before its hello: both count.
    let bound = app.bind(&cred.token, &sub, 1).await;
    let before_hello = app.connect(&cred.token).await;
    let res = upgrade(&app, "", &[proto, ("Authorization", &auth)]).await;
    res.assert_error(429, "CAPACITY_EXCEEDED");
    assert_eq!(res.headers["retry-after"], "1");

    // A closed connection frees its slot.
    drop(before_hello);
    drop(bound);
    let (app, auth) = (&app, auth.as_str());
    wait_until("a slot is free again", || async move {
        ws_connect(app, &[proto, ("Authorization", auth)])
            .await
            .is_ok()
    })
    .await;
}

#[actix_web::test]
async fn the_upgrade_checks_run_in_the_order_of_the_spec() {
    let app = spawn_app_with(|s| s.limits.max_connections = 1).await;
    let cred = app.bootstrap().await;
    let publisher = app.bootstrap_with("demo", "pub", "q2", false, true).await;
    let auth = bearer(&cred);
    let pub_auth = bearer(&publisher);
    let origin = ("Origin", "https://evil.example");
    let proto = ("Sec-WebSocket-Protocol", "orbit.events.v1");
    let _occupied = app.connect(&cred.token).await;

    // query string before auth
    upgrade(&app, "?a=b", &[origin])
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    // auth before permission, Origin, protocol and capacity
    upgrade(&app, "", &[origin])
        .await
        .assert_error(401, "UNAUTHENTICATED");
    // permission before Origin
    let res = upgrade(&app, "", &[("Authorization", &pub_auth), origin]).await;
    res.assert_error(403, "PERMISSION_DENIED");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("events:consume")
    );
    // Origin before the subprotocol
    let res = upgrade(&app, "", &[("Authorization", &auth), origin]).await;
    res.assert_error(403, "PERMISSION_DENIED");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Origin")
    );
    // the subprotocol before the node limit
    upgrade(&app, "", &[("Authorization", &auth)])
        .await
        .assert_error(426, "PROTOCOL_REQUIRED");
    // and last the node limit
    upgrade(&app, "", &[("Authorization", &auth), proto])
        .await
        .assert_error(429, "CAPACITY_EXCEEDED");
}
