//! protocol.md §1 (message size, binary frames) and §2 (the envelope): what
//! closes the connection with 1008/1009 and what is only an error frame.

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{
    Message,
    protocol::frame::{
        Frame,
        coding::{CloseCode, Data, OpCode},
    },
};

use crate::{helpers::*, protocol_support::*};

const MAX: usize = 524_288;

/// A bound session on a fresh node (no deliveries: nothing is published).
async fn bound() -> (TestApp, Cred, String, WsClient) {
    bound_session(|_| {}, 1).await
}

/// A valid ping of exactly `len` bytes (whitespace before the last brace).
fn ping_of_len(ws: &WsClient, len: usize) -> (String, Value) {
    let (text, id) = frame_text(ws, "events.ping", json!({}));
    let body = text.strip_suffix('}').unwrap();
    let padding = len - text.len();
    (format!("{body}{}}}", " ".repeat(padding)), id)
}

#[actix_web::test]
async fn text_that_is_not_strict_json_closes_the_connection_with_1008() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    type Case = Box<dyn Fn(&str) -> String>;
    let cases: Vec<Case> = vec![
        Box::new(|_| "not json".to_owned()),
        Box::new(|_| "".to_owned()),
        Box::new(|s| format!(r#"["1","events.ping","{}","{s}",{{}}]"#, mid())),
        Box::new(|s| {
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{}","session_id":"{s}","body":{{}}}} trailing"#,
                mid()
            )
        }),
        Box::new(|s| {
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{}","session_id":"{s}","body":{{}}}}{{}}"#,
                mid()
            )
        }),
        // a duplicate key at the top level, and deep inside the body
        Box::new(|s| {
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","type":"events.ping","message_id":"{}","session_id":"{s}","body":{{}}}}"#,
                mid()
            )
        }),
        Box::new(|s| {
            format!(
                r#"{{"protocol_version":"1","type":"event.ack","message_id":"{}","session_id":"{s}","body":{{"delivery_id":"{}","epoch":"1","epoch":"1","lease_secret":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}}}}"#,
                mid(),
                mid()
            )
        }),
        // the same key, once escaped
        Box::new(|s| {
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{}","session_id":"{s}","sessio\u006e_id":"{s}","body":{{}}}}"#,
                mid()
            )
        }),
    ];
    for (i, case) in cases.iter().enumerate() {
        let mut ws = app.bind(&cred.token, &sub, 1).await;
        let text = case(ws.session_id.as_deref().unwrap());
        send_invalid(&mut ws, &text).await;
        match ws.recv().await {
            Received::Closed(c) => {
                assert_eq!(
                    c.map(|c| c.code),
                    Some(CloseCode::Policy),
                    "case {i}: {text}"
                )
            }
            Received::Frame(f) => panic!("case {i}: expected 1008, got {f:#}"),
        }
    }
}

#[actix_web::test]
async fn an_invalid_envelope_closes_the_connection_with_1008() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    type Case = Box<dyn Fn(&str) -> Value>;
    let cases: Vec<Case> = vec![
        Box::new(
            |s| json!({"protocol_version": "2", "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": 1, "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"type": "events.ping", "message_id": mid(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.pong", "message_id": mid(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "ack", "message_id": mid(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": mid().to_uppercase(), "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": "abc", "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "session_id": s, "body": {}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}, "extra": 1}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}, "reply_to": mid()}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}, "error": {"code": "NOT_FOUND", "message": "x"}}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": mid(), "session_id": s, "body": {}, "Type": "x"}),
        ),
        Box::new(
            |s| json!({"protocol_version": "1", "type": "events.ping", "message_id": null, "session_id": s, "body": {}}),
        ),
    ];
    for (i, case) in cases.iter().enumerate() {
        let mut ws = app.bind(&cred.token, &sub, 1).await;
        let frame = case(ws.session_id.as_deref().unwrap());
        send_invalid(&mut ws, &frame.to_string()).await;
        match ws.recv().await {
            Received::Closed(c) => {
                assert_eq!(
                    c.map(|c| c.code),
                    Some(CloseCode::Policy),
                    "case {i}: {frame}"
                )
            }
            Received::Frame(f) => panic!("case {i}: expected 1008, got {f:#}"),
        }
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_hello_carrying_session_id_reply_to_or_error_closes_with_1008() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    for extra in [
        json!({"session_id": mid()}),
        json!({"reply_to": mid()}),
        json!({"error": {"code": "NOT_FOUND", "message": "x"}}),
    ] {
        let mut ws = app.connect(&cred.token).await;
        let mut hello = ws.envelope(
            "events.hello",
            json!({"subscription_id": sub, "capacity": 1}),
        );
        for (k, v) in extra.as_object().unwrap() {
            hello[k] = v.clone();
        }
        send_invalid(&mut ws, &hello.to_string()).await;
        expect_close_only(&mut ws, CloseCode::Policy).await;
    }
    // No session was recorded for any of them.
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 0);
}

#[actix_web::test]
async fn a_missing_or_wrong_session_id_after_the_hello_closes_with_1008() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    for session in [None, Some(mid())] {
        let mut ws = app.bind(&cred.token, &sub, 1).await;
        ws.session_id = session;
        let ping = ws.envelope("events.ping", json!({}));
        send_invalid(&mut ws, &ping.to_string()).await;
        expect_close_only(&mut ws, CloseCode::Policy).await;
    }
    // A frame other than the hello before the hello is refused the same way.
    let mut ws = app.connect(&cred.token).await;
    ws.session_id = Some(mid());
    let ping = ws.envelope("events.ping", json!({}));
    send_invalid(&mut ws, &ping.to_string()).await;
    expect_close_only(&mut ws, CloseCode::Policy).await;
    // And a second hello on a bound session.
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    ws.session_id = None;
    let hello = ws.envelope(
        "events.hello",
        json!({"subscription_id": sub, "capacity": 1}),
    );
    ws.send_json(hello).await;
    expect_close_only(&mut ws, CloseCode::Policy).await;
}

#[actix_web::test]
async fn a_binary_frame_closes_the_connection_with_1008() {
    let (_app, _cred, _sub, mut ws) = bound().await;
    let ping = ws.envelope("events.ping", json!({}));
    send_raw(&mut ws, Message::binary(ping.to_string().into_bytes())).await;
    expect_close_only(&mut ws, CloseCode::Policy).await;
}

#[actix_web::test]
async fn a_message_of_exactly_524288_bytes_is_accepted_and_one_byte_more_closes_with_1009() {
    let (_app, _cred, _sub, mut ws) = bound().await;
    let (text, id) = ping_of_len(&ws, MAX);
    assert_eq!(text.len(), MAX);
    ws.send_text(&text).await;
    let reply = ws.frame().await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    assert_eq!(reply["reply_to"], id);

    let (text, _) = ping_of_len(&ws, MAX + 1);
    ws.send_text(&text).await;
    expect_close_only(&mut ws, CloseCode::Size).await;
}

#[actix_web::test]
async fn the_512_kib_limit_counts_every_fragment_of_a_message() {
    let (_app, _cred, _sub, mut ws) = bound().await;
    // Exactly 524,288 bytes in three fragments: accepted.
    let (text, id) = ping_of_len(&ws, MAX);
    crate::helpers::assert_frame_valid("clientFrame", &serde_json::from_str(&text).unwrap());
    send_fragments(&mut ws, text.as_bytes(), 3).await;
    let reply = ws.frame().await;
    assert_eq!(reply["reply_to"], id, "{reply:#}");

    // One byte more, in fragments each well below the limit: 1009.
    let (text, _) = ping_of_len(&ws, MAX + 1);
    send_fragments(&mut ws, text.as_bytes(), 4).await;
    expect_close_only(&mut ws, CloseCode::Size).await;
}

#[actix_web::test]
async fn a_message_in_more_than_1024_fragments_closes_with_1008() {
    let (_app, _cred, _sub, mut ws) = bound().await;
    let (text, _) = ping_of_len(&ws, 2_000);
    send_fragments(&mut ws, text.as_bytes(), 1_025).await;
    expect_close_only(&mut ws, CloseCode::Policy).await;
}

/// Sends `bytes` as one text message in `n` fragments (not JSON frames on
/// their own, so they bypass schema validation).
async fn send_fragments(ws: &mut WsClient, bytes: &[u8], n: usize) {
    let chunk = bytes.len().div_ceil(n);
    let parts: Vec<&[u8]> = bytes.chunks(chunk).collect();
    let mut parts: Vec<Vec<u8>> = parts.into_iter().map(<[u8]>::to_vec).collect();
    while parts.len() < n {
        parts.push(Vec::new());
    }
    let last = parts.len() - 1;
    for (i, part) in parts.into_iter().enumerate() {
        let opcode = if i == 0 {
            OpCode::Data(Data::Text)
        } else {
            OpCode::Data(Data::Continue)
        };
        send_raw(ws, Message::Frame(Frame::message(part, opcode, i == last))).await;
    }
}

#[actix_web::test]
async fn an_invalid_body_gets_invalid_argument_with_reply_to_and_the_connection_stays() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;

    // A hello with capacity 0 or 33, or a capacity that is not an integer:
    // the error names no session, and a good hello still binds.
    let mut ws = app.connect(&cred.token).await;
    for capacity in [json!(0), json!(33), json!("1"), json!(1.5)] {
        let (text, id) = frame_text(
            &ws,
            "events.hello",
            json!({"subscription_id": sub, "capacity": capacity}),
        );
        send_invalid(&mut ws, &text).await;
        let err = ws.frame().await;
        assert_error_frame(&err, "INVALID_ARGUMENT");
        assert_eq!(err["reply_to"], id);
        assert!(err.get("session_id").is_none(), "{err:#}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("capacity"),
            "{err:#}"
        );
    }
    assert_eq!(ws.hello(&sub, 2).await["type"], "events.welcome");

    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let d = ws.delivery().await;
    let delivery_id = d["body"]["delivery"]["id"].as_str().unwrap().to_owned();
    let secret = d["body"]["lease_secret"].as_str().unwrap().to_owned();
    let session = ws.session_id.clone().unwrap();
    let bad_bodies = [
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "01", "lease_secret": secret}),
            "epoch",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": 1, "lease_secret": secret}),
            "epoch",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "1", "lease_secret": &secret[..42]}),
            "lease_secret",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "1", "lease_secret": format!("{secret}=")}),
            "lease_secret",
        ),
        // 43 characters whose last one carries non-zero unused bits
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "1", "lease_secret": format!("{}B", &"A".repeat(42))}),
            "lease_secret",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "1", "lease_secret": format!("{}+", &"A".repeat(42))}),
            "lease_secret",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id, "epoch": "1"}),
            "lease_secret",
        ),
        (
            "event.ack",
            json!({"delivery_id": delivery_id.to_uppercase(), "epoch": "1", "lease_secret": secret}),
            "delivery_id",
        ),
        ("events.ping", json!({"x": 1}), "body"),
        ("events.ping", json!([]), "body"),
        ("events.ping", json!(null), "body"),
    ];
    for (frame_type, body, field) in bad_bodies {
        let (text, id) = frame_text(&ws, frame_type, body.clone());
        send_invalid(&mut ws, &text).await;
        let err = ws.frame().await;
        assert_error_frame(&err, "INVALID_ARGUMENT");
        assert_eq!(err["reply_to"], id, "{body}");
        assert_eq!(err["session_id"], session.as_str());
        assert!(
            err["error"]["message"].as_str().unwrap().contains(field),
            "{body}: {err:#}"
        );
    }
    // The connection stayed, and the delivery is still ACKable.
    ping_expect_ack(&mut ws).await;
    let ok = ws.ack(&d).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["deduplicated"], false);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_for_an_unknown_delivery_gets_not_found_and_closes_with_1008() {
    let (app, _cred, _sub, mut ws) = bound().await;
    let ack = ws.envelope(
        "event.ack",
        json!({"delivery_id": mid(), "epoch": "1", "lease_secret": "A".repeat(43)}),
    );
    let id = ack["message_id"].clone();
    ws.send_json(ack).await;
    expect_error_then_close(&mut ws, "NOT_FOUND", Some(&id), CloseCode::Policy).await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_for_another_subscriptions_delivery_gets_not_found_and_closes_with_1008() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub_a = subscription(&app, &cred).await;
    let sub_b = subscription(&app, &cred).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let mut a = app.bind(&cred.token, &sub_a, 1).await;
    let d = a.delivery().await;

    let mut b = app.bind(&cred.token, &sub_b, 1).await;
    // b has its own delivery of the same event; ACK a's proof on b.
    let own = b.delivery().await;
    assert_ne!(own["body"]["delivery"]["id"], d["body"]["delivery"]["id"]);
    let ack = b.envelope("event.ack", proof(&d));
    let id = ack["message_id"].clone();
    b.send_json(ack).await;
    let err = expect_error_then_close(&mut b, "NOT_FOUND", Some(&id), CloseCode::Policy).await;
    assert!(err["session_id"].is_string());
    // a's delivery was not touched.
    let ok = a.ack(&d).await;
    assert_eq!(ok["body"]["deduplicated"], false, "{ok:#}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn server_frames_carry_fresh_message_ids_and_replies_name_the_request_in_reply_to() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.connect(&cred.token).await;
    let hello = ws.envelope(
        "events.hello",
        json!({"subscription_id": sub, "capacity": 2}),
    );
    let hello_id = hello["message_id"].clone();
    ws.send_json(hello).await;
    let welcome = ws.frame().await;
    assert_eq!(welcome["type"], "events.welcome");
    assert_eq!(welcome["reply_to"], hello_id);
    assert_eq!(welcome["session_id"], welcome["body"]["session_id"]);
    ws.session_id = welcome["session_id"].as_str().map(str::to_owned);

    app.publish(
        &cred,
        vec![
            result(&cred.queue_id, "task.succeeded"),
            result(&cred.queue_id, "task.failed"),
        ],
    )
    .await;
    let d1 = ws.delivery().await;
    let d2 = ws.delivery().await;
    assert!(
        d1.get("reply_to").is_none(),
        "a delivery answers no request"
    );
    let ack = ws.ack(&d1).await;
    let ping = ping_expect_ack(&mut ws).await;
    let ids: std::collections::HashSet<&str> = [&welcome, &d1, &d2, &ack, &ping]
        .iter()
        .map(|f| f["message_id"].as_str().unwrap())
        .chain([hello_id.as_str().unwrap()])
        .collect();
    assert_eq!(ids.len(), 6, "every frame has its own message_id");
    for f in [&d1, &d2, &ack, &ping] {
        assert_eq!(f["session_id"], welcome["session_id"]);
    }
}
