//! Publishes in SQLite write rounds (decision 0068): a publish batch that
//! shares a round's transaction with other writes is still answered
//! exactly as it was committed (http-api.md §1 deadline, §2 idempotency,
//! §4 result ingest; delivery-model.md: persisted before announced). The
//! test itself takes seats in the node's rounds (`Database::write` on the
//! node's own `Database`) to hold a round open or to spoil it. On
//! PostgreSQL there are no rounds: these tests skip themselves there.

use std::time::Duration;

use orbit_events::{
    domain::{QueueId, ResultType, now},
    journal::{self, NewResult},
    store::{Database, StoreError},
};
use serde_json::{Value, json};
use tokio::{sync::oneshot, task::JoinHandle};

use crate::{helpers::*, protocol_support::wait_until};

/// True (after saying so) when this run has no write rounds (PostgreSQL).
fn skip_without_rounds() -> bool {
    skip_unless_backend("sqlite", "write rounds exist on SQLite only")
}

/// A POST on its own task, so the test can act while it waits.
fn spawn_post(app: &TestApp, path: &str, token: &str, key: &str, body: &Value) -> JoinHandle<Resp> {
    let (http, url) = (app.http.clone(), format!("{}{}", app.address, path));
    let (token, key, body) = (token.to_owned(), key.to_owned(), body.to_string());
    tokio::spawn(async move {
        let res = http
            .post(url)
            .bearer_auth(token)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request");
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.unwrap();
        Resp {
            status,
            headers,
            body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        }
    })
}

/// What a test member of a round does once it holds the transaction.
#[derive(Clone, Copy)]
enum Member {
    /// Appends one result to the queue, then waits for its release.
    AppendsThenWaits,
    /// Waits for its release, writing nothing.
    Waits,
    /// Fails at once (its round rolls back).
    Fails,
}

/// A test member's task, its "body began" signals and its release.
type HeldMember = (
    JoinHandle<Result<Vec<i64>, StoreError>>,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    oneshot::Sender<()>,
);

/// A member of the node's current write round (or of a new one), run by
/// the test: returns its task, a signal sent each time its body begins and
/// (for the waiting kinds) the sender that releases its first run. Its
/// answer: the sequences it appended.
fn member(db: &Database, queue_id: &str, kind: Member) -> HeldMember {
    let (began, began_rx) = tokio::sync::mpsc::unbounded_channel();
    let (release, released) = oneshot::channel::<()>();
    let db = db.clone();
    let queue_id = QueueId::parse(queue_id).unwrap();
    let mut released = Some(released);
    let task = tokio::spawn(async move {
        db.write::<_, StoreError, _>(async move |txn| {
            let _ = began.send(());
            let mut sequences = Vec::new();
            if let Member::AppendsThenWaits = kind {
                // Shaped as an ingested result (the deliveries are checked
                // against the protocol's schema).
                let r = result(queue_id.as_str(), "task.succeeded");
                let result = NewResult {
                    result_type: ResultType::Succeeded,
                    aggregate_id: r["aggregate_id"].as_str().unwrap().to_owned(),
                    aggregate_revision: r["aggregate_revision"].as_str().unwrap().to_owned(),
                    occurred_at: now(),
                    details: r["details"].to_string(),
                    snapshot: r["snapshot"].to_string(),
                };
                let appended = journal::append_many(
                    &**txn,
                    &[(&queue_id, std::slice::from_ref(&result))],
                    now(),
                )
                .await?;
                sequences = appended
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|(_, s)| s)
                    .collect();
            }
            match kind {
                Member::Fails => return Err(StoreError::invariant("rejected by the test")),
                // Only the first run waits (a spoiled member runs again alone).
                _ => {
                    if let Some(released) = released.take() {
                        let _ = released.await;
                    }
                }
            }
            Ok(sequences)
        })
        .await
    });
    (task, began_rx, release)
}

async fn seated(app: &TestApp, n: usize) {
    let db = &app.state.db;
    wait_until(
        &format!("{n} members are seated in the round"),
        || async move { db.write_round_seated() == n },
    )
    .await;
}

/// `(id, sequence)` of each event of a publish response, in order.
fn events_of(res: &Resp) -> Vec<(String, i64)> {
    res.data()["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no events in {:#}", res.body))
        .iter()
        .map(|e| {
            (
                e["id"].as_str().unwrap().to_owned(),
                e["sequence"].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

async fn committed_events(app: &TestApp, queue_id: &str) -> Vec<(String, i64)> {
    let ids: Vec<String> = app
        .column(&format!(
            "SELECT id FROM result_events WHERE queue_id = '{queue_id}' ORDER BY sequence"
        ))
        .await;
    let sequences: Vec<i64> = app
        .column(&format!(
            "SELECT sequence FROM result_events WHERE queue_id = '{queue_id}' ORDER BY sequence"
        ))
        .await;
    ids.into_iter().zip(sequences).collect()
}

/// http-api.md §1 (at the deadline: 503 and rolled back), decision 0014:
/// a publish whose statements ran before its deadline, in a round another
/// member keeps open past it, is not answered 503 (it would be committed
/// with its round): it is answered its committed outcome once the round
/// commits. (Its deadline passing before its batch reaches it — 503,
/// nothing written — is `group_commit`'s test.)
#[actix_web::test]
async fn a_publish_committing_when_its_deadline_passes_is_answered_its_outcome_not_503() {
    if skip_without_rounds() {
        return;
    }
    let deadline = Duration::from_millis(1_500);
    let app = spawn_app_with(|s| {
        s.timing.http_request_timeout_ms = deadline.as_millis() as u64;
        s.timing.scan_interval_ms = 600_000;
    })
    .await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let path = format!("/v1/queues/{q}/results");
    let body = json!({ "results": [result(&q, "task.succeeded")] });

    // A round held open by a first member; the publish takes the next
    // seat, a second held member the one after it.
    let (first, mut first_began, release_first) = member(&app.state.db, &q, Member::Waits);
    first_began.recv().await.unwrap();
    let mut publish = spawn_post(&app, &path, &cred.token, "late", &body);
    seated(&app, 2).await;
    let (second, mut second_began, release_second) = member(&app.state.db, &q, Member::Waits);
    seated(&app, 3).await;
    // The publish's statements run (well before its deadline), then the
    // second member keeps the round open past the deadline.
    release_first.send(()).unwrap();
    second_began.recv().await.unwrap();
    // No answer while its round is open, deadline or not (twice it).
    let early = tokio::time::timeout(2 * deadline, &mut publish).await;
    assert!(
        early.is_err(),
        "answered before its round committed: {early:?}"
    );
    release_second.send(()).unwrap();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    let res = publish.await.unwrap();

    // The answer is what was committed; the key replays it.
    assert_eq!(res.status, 201, "{:#}", res.body);
    let published = events_of(&res);
    assert_eq!(published.len(), 1);
    assert_eq!(committed_events(&app, &q).await, published);
    let again = app.post(&path, &cred.token, "late", &body).await;
    assert_eq!(again.status, 200, "{:#}", again.body);
    assert_eq!(events_of(&again), published);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_publish_whose_round_another_write_spoils_answers_the_events_and_sequences_committed() {
    if skip_without_rounds() {
        return;
    }
    // No poll of the scanner: the test's members are the round's only
    // ones besides the publish.
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    // Its cursor starts at the head, 0: every event below is delivered.
    let sub = app.subscribe(&cred, json!({})).await;
    let path = format!("/v1/queues/{q}/results");
    let results: Vec<Value> = (0..2).map(|_| result(&q, "task.failed")).collect();
    let body = json!({ "results": results });

    // Round: a member that appends to the same queue (and waits), the
    // publish (whose first run takes the sequences after it), a member
    // that fails and so spoils the round.
    let (appender, mut appender_began, release) =
        member(&app.state.db, &q, Member::AppendsThenWaits);
    appender_began.recv().await.unwrap();
    let publish = spawn_post(&app, &path, &cred.token, "spoiled", &body);
    seated(&app, 2).await;
    let (failing, _, _) = member(&app.state.db, &q, Member::Fails);
    seated(&app, 3).await;
    // The same key again, while the first is in its round: it waits for it.
    let repeat = spawn_post(&app, &path, &cred.token, "spoiled", &body);
    release.send(()).unwrap();

    let failing = failing.await.unwrap().unwrap_err();
    assert!(failing.to_string().contains("rejected"), "{failing}");
    // Both ran again alone, in either order.
    let appended = appender.await.unwrap().unwrap();
    let res = publish.await.unwrap();
    assert_eq!(res.status, 201, "{:#}", res.body);
    let published = events_of(&res);
    assert_eq!(published.len(), 2);

    // The answer is what was committed: these ids with these sequences,
    // no gap and no sequence twice in the log, the head at its end.
    let committed = committed_events(&app, &q).await;
    assert_eq!(
        committed.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    for event in &published {
        assert!(committed.contains(event), "{event:?} not in {committed:?}");
    }
    let mut sequences: Vec<i64> = published.iter().map(|(_, s)| *s).collect();
    assert!(
        sequences.windows(2).all(|w| w[1] == w[0] + 1),
        "{sequences:?}"
    );
    sequences.extend(&appended);
    sequences.sort_unstable();
    assert_eq!(sequences, vec![1, 2, 3]);
    let head = app
        .scalar(&format!(
            "SELECT head_sequence FROM queues WHERE id = '{q}'"
        ))
        .await;
    assert_eq!(head, 3);

    // The key was recorded once, with that answer: the concurrent repeat
    // and a later one replay it.
    let repeat = repeat.await.unwrap();
    assert_eq!(repeat.status, 200, "{:#}", repeat.body);
    assert_eq!(repeat.data()["deduplicated"], true);
    assert_eq!(events_of(&repeat), published);
    let later = app.post(&path, &cred.token, "spoiled", &body).await;
    assert_eq!(later.status, 200, "{:#}", later.body);
    assert_eq!(events_of(&later), published);
    let records = app
        .scalar("SELECT COUNT(*) FROM idempotency_records WHERE key = 'spoiled'")
        .await;
    assert_eq!(records, 1);

    // Announced as committed: the deliveries carry the committed events.
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 8).await;
    let mut delivered = Vec::new();
    for _ in 0..3 {
        let d = ws.delivery().await;
        let event = &d["body"]["event"];
        delivered.push((
            event["id"].as_str().unwrap().to_owned(),
            event["sequence"].as_str().unwrap().parse::<i64>().unwrap(),
        ));
    }
    delivered.sort_by_key(|(_, s)| *s);
    assert_eq!(delivered, committed);
    assert!(
        ws.delivery_within(Duration::from_millis(200))
            .await
            .is_none()
    );
    app.assert_invariants().await;
}

/// delivery-model.md §3 (nothing silently skipped), decision 0098: a
/// publish wakes the scanner before its commit, so a waiting session's
/// claim can share that commit. When another member spoils the round, the
/// publish runs again alone and commits later; its result still reaches the
/// waiting session at once, not on the fallback poll (600 s here).
#[actix_web::test]
async fn a_result_whose_publish_ran_again_after_its_round_was_spoiled_still_reaches_the_waiting_session()
 {
    if skip_without_rounds() {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let sub: Value = app.subscribe(&cred, json!({})).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 1).await;
    crate::protocol_support::claims_settled(&app, 1).await;
    let path = format!("/v1/queues/{q}/results");
    let body = json!({ "results": [result(&q, "task.succeeded")] });

    // Round: a member holding it open, the publish, a member that fails.
    let (holder, mut holder_began, release) = member(&app.state.db, &q, Member::Waits);
    holder_began.recv().await.unwrap();
    let publish = spawn_post(&app, &path, &cred.token, "rerun", &body);
    seated(&app, 2).await;
    let (failing, _, _) = member(&app.state.db, &q, Member::Fails);
    seated(&app, 3).await;
    release.send(()).unwrap();
    assert!(failing.await.unwrap().is_err());
    holder.await.unwrap().unwrap();
    let res = publish.await.unwrap();
    assert_eq!(res.status, 201, "{:#}", res.body);
    let (event_id, _) = events_of(&res).remove(0);

    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], event_id.as_str(), "{d:#}");
    assert_eq!(ws.ack(&d).await["type"], "ack");
    app.assert_invariants().await;
}
