//! protocol.md §3 "On server shutdown (SIGTERM or SIGINT), connections
//! close with 1001 after in-flight database work has finished".

use std::time::Duration;

use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::{helpers::*, protocol_support::*};

#[actix_web::test]
async fn on_shutdown_a_connection_closes_with_1001_only_after_its_in_flight_ack_has_committed_and_been_answered()
 {
    let (app, cred, sub, mut ws) = bound_session(|_| {}, 1).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let d = ws.delivery().await;
    let mut idle = app.bind(&cred.token, &sub, 1).await;
    claims_settled(&app, 2).await;

    // The ACK's transaction waits on the database...
    let block = block_writes(&app, &sub).await;
    let ack = ws.envelope("event.ack", proof(&d));
    let ack_id = ack["message_id"].clone();
    ws.send_json(ack).await;
    // ...(a ping answered after it proves the node took the ACK)...
    ping_expect_ack(&mut ws).await;
    // ...when the node is told to stop.
    app.state.shutdown.begin();

    // A connection with nothing in flight closes at once.
    expect_close_only(&mut idle, CloseCode::Away).await;
    // The other one waits for its ACK.
    assert!(
        ws.recv_within(Duration::from_millis(500)).await.is_none(),
        "closed while its ACK was in flight"
    );
    block.release().await;
    let reply = ws.frame().await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    assert_eq!(reply["reply_to"], ack_id);
    assert_eq!(reply["body"]["deduplicated"], false);
    expect_close_only(&mut ws, CloseCode::Away).await;

    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'ACKED'",
            d["body"]["delivery"]["id"].as_str().unwrap()
        ))
        .await,
        1
    );
    let app_ref = &app;
    wait_until("every session is recorded closed", || async move {
        app_ref
            .scalar("SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL")
            .await
            == 0
    })
    .await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn sigterm_and_sigint_close_every_connection_with_1001_and_the_node_exits_successfully() {
    for signal in ["TERM", "INT"] {
        let mut app = spawn_app().await;
        let cred = app.bootstrap().await;
        let mut node = NodeProcess::serve_for(&mut app, &[]).await;
        let sub = subscription(&app, &cred).await;
        let mut a = app.bind(&cred.token, &sub, 2).await;
        let mut b = app.bind(&cred.token, &sub, 2).await;
        publish_one(&app, &cred, "task.succeeded").await;
        let d = tokio::select! {
            d = a.delivery() => d,
            d = b.delivery() => d,
        };

        node.signal(signal);
        for ws in [&mut a, &mut b] {
            match ws.recv().await {
                Received::Closed(c) => {
                    let c = c.expect("a close frame");
                    assert_eq!(c.code, CloseCode::Away, "SIG{signal}");
                    assert_eq!(c.reason.as_str(), "the server is shutting down");
                }
                Received::Frame(f) => panic!("SIG{signal}: expected the close, got {f:#}"),
            }
        }
        let status = node.exited().await;
        assert!(status.success(), "SIG{signal}: {status}: {}", node.log());
        assert_eq!(
            app.scalar("SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL")
                .await,
            0,
            "every session of the node is recorded closed"
        );
        // The lease survives the node and is recovered later.
        assert_eq!(
            app.scalar(&format!(
                "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'LEASED'",
                d["body"]["delivery"]["id"].as_str().unwrap()
            ))
            .await,
            1
        );
        app.assert_invariants().await;
    }
}
