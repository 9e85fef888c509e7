//! Human-readable tables of the admin commands.

use chrono::SecondsFormat;
use comfy_table::{Table, presets};

use crate::{
    DeliveryDetail, DeliveryState, DeliveryStep, EventDelivery, Queue, ResultType, RetryReceipt,
    StepKind, Subscription, SubscriptionStatus, types::Time,
};

/// Columns separated by two spaces, no borders, a header row.
fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    table.set_header(header.to_vec());
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    table
}

/// `rows` under `header` in the style of every table of the command line
/// (columns separated by two spaces, no borders), for the `orbit-events`
/// commands that are not HTTP clients (`credential list`).
pub fn plain_table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = table(header);
    for row in rows {
        t.add_row(row);
    }
    t.trim_fmt()
}

/// Two columns, `field  value`, no header.
fn fields(rows: Vec<(&str, String)>) -> String {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    for (name, value) in rows {
        table.add_row(vec![format!("{name}:"), value]);
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    table.trim_fmt()
}

/// Text from the server as one line: control characters (escape
/// sequences, newlines) are shown escaped, so a reason cannot redraw the
/// terminal or fake a row.
fn printable(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

fn time(t: &Time) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn types(types: &[ResultType]) -> String {
    if types.len() == ResultType::ALL.len() {
        return "all".to_owned();
    }
    types
        .iter()
        .map(|t| t.as_str().trim_start_matches("task."))
        .collect::<Vec<_>>()
        .join(",")
}

fn state(s: &Subscription) -> &'static str {
    if s.enabled { "active" } else { "paused" }
}

/// `subscriptions list`.
pub fn subscriptions_table(items: &[Subscription]) -> String {
    if items.is_empty() {
        return "No subscriptions of this credential on this queue.".to_owned();
    }
    let mut t = table(&[
        "ID", "NAME", "STATE", "TYPES", "CURSOR", "PENDING", "REVISION", "CREATED",
    ]);
    for s in items {
        t.add_row(vec![
            s.id.clone(),
            s.name.clone(),
            state(s).to_owned(),
            types(&s.types),
            s.cursor_sequence.to_string(),
            format!("{}/{}", s.pending_count, s.max_pending),
            s.revision.to_string(),
            time(&s.created_at),
        ]);
    }
    t.trim_fmt()
}

/// `subscriptions get` and the writes.
pub fn subscription_detail(s: &Subscription) -> String {
    fields(vec![
        ("id", s.id.clone()),
        ("name", s.name.clone()),
        ("queue", s.queue_id.clone()),
        (
            "state",
            format!(
                "{} ({})",
                state(s),
                if s.enabled {
                    "new results are delivered"
                } else {
                    "no new deliveries until resumed"
                }
            ),
        ),
        ("types", types(&s.types)),
        (
            "cursor",
            format!(
                "{} (the log is read into deliveries up to this sequence)",
                s.cursor_sequence
            ),
        ),
        (
            "pending",
            format!(
                "{} of at most {} (deliveries not yet ACKed)",
                s.pending_count, s.max_pending
            ),
        ),
        ("max attempts", s.max_attempts.to_string()),
        ("revision", s.revision.to_string()),
        ("credential", s.credential_id.clone()),
        ("created", time(&s.created_at)),
        ("updated", time(&s.updated_at)),
    ])
}

/// What a delivery is waiting for, in words.
fn status(d: &EventDelivery) -> String {
    match d.state {
        DeliveryState::Pending => format!("offered from {}", time(&d.available_at)),
        DeliveryState::Leased => d
            .lease_until
            .map(|t| format!("leased until {}", time(&t)))
            .unwrap_or_default(),
        DeliveryState::Acked => d
            .acknowledged_at
            .map(|t| format!("ACKed at {}", time(&t)))
            .unwrap_or_default(),
        DeliveryState::Expired => "out of attempts: `deliveries retry` re-arms it".to_owned(),
    }
}

/// `deliveries list`.
pub fn deliveries_table(items: &[EventDelivery]) -> String {
    if items.is_empty() {
        return "No deliveries.".to_owned();
    }
    let mut t = table(&[
        "ID", "SEQUENCE", "STATE", "ATTEMPTS", "EPOCH", "REVISION", "EVENT", "STATUS",
    ]);
    for d in items {
        t.add_row(vec![
            d.id.clone(),
            d.sequence.to_string(),
            d.state.to_string(),
            format!("{}/{}", d.attempts, d.attempt_budget),
            d.lease_epoch.to_string(),
            d.revision.to_string(),
            d.event_id.clone(),
            status(d),
        ]);
    }
    t.trim_fmt()
}

/// The fields of one delivery.
pub fn delivery_fields(d: &EventDelivery) -> String {
    fields(vec![
        ("delivery", d.id.clone()),
        ("subscription", d.subscription_id.clone()),
        ("state", format!("{} ({})", d.state, status(d))),
        (
            "attempts",
            format!("{} of a budget of {}", d.attempts, d.attempt_budget),
        ),
        ("lease epoch", d.lease_epoch.to_string()),
        ("revision", d.revision.to_string()),
        ("sequence", d.sequence.to_string()),
        ("event", d.event_id.clone()),
        ("created", time(&d.created_at)),
    ])
}

/// `deliveries get`: the delivery, then its event.
pub fn delivery_detail(detail: &DeliveryDetail) -> String {
    let e = &detail.event;
    let mut event = vec![
        ("event", e.id.clone()),
        ("type", e.event_type.to_string()),
        ("task", e.aggregate_id.clone()),
        ("task revision", e.aggregate_revision.to_string()),
        ("occurred", time(&e.occurred_at)),
        ("effect uncertain", e.snapshot.effect_uncertain.to_string()),
        ("details", e.details.get().to_owned()),
    ];
    if let Some(result) = &e.snapshot.result {
        event.push(("result", result.get().to_owned()));
    }
    format!("{}\n\n{}", delivery_fields(&detail.delivery), fields(event))
}

/// `subscriptions status` (and the end of `subscriptions get`).
pub fn status_detail(s: &SubscriptionStatus) -> String {
    let mut rows = vec![
        (
            "moving",
            if s.blocked.is_empty() {
                "yes".to_owned()
            } else {
                "no".to_owned()
            },
        ),
        (
            "log",
            format!(
                "head {}, retention floor {}",
                s.head_sequence, s.retention_floor
            ),
        ),
        (
            "cursor",
            format!(
                "{} ({} after it in the log, of any type)",
                s.cursor_sequence, s.lag
            ),
        ),
        (
            "backlog",
            format!(
                "{} of at most {}: {} pending, {} leased, {} expired",
                s.pending_count, s.max_pending, s.pending, s.leased, s.expired
            ),
        ),
    ];
    if let Some(o) = &s.oldest_unacked {
        rows.push((
            "oldest unacked",
            format!(
                "sequence {} ({}), {:.0} s old, delivery {}",
                o.sequence, o.state, o.age_seconds, o.delivery_id
            ),
        ));
    }
    rows.push((
        "consumers",
        if s.sessions.is_empty() {
            "none connected".to_owned()
        } else {
            s.sessions
                .iter()
                .map(|x| {
                    format!(
                        "session {} on node {}: holds {} of {}, since {}",
                        x.session_id,
                        x.node_id,
                        x.held,
                        x.capacity,
                        time(&x.opened_at)
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        },
    ));
    if let Some(c) = &s.last_configure {
        rows.push((
            "last configure",
            format!(
                "{} at {} by credential {} (revision {}): {}",
                if c.enabled { "resumed" } else { "paused" },
                time(&c.at),
                c.credential_id,
                c.revision,
                printable(&c.reason)
            ),
        ));
    }
    for b in &s.blocked {
        let earliest = b
            .earliest_sequence
            .as_ref()
            .map(|e| format!(" (earliest sequence {e})"))
            .unwrap_or_default();
        rows.push((
            "blocked",
            format!("{}{earliest}: {}", b.code, printable(&b.message)),
        ));
    }
    fields(rows)
}

/// `deliveries history`.
pub fn history_table(items: &[DeliveryStep]) -> String {
    let mut t = table(&["AT", "STEP", "EPOCH", "SESSION", "NODE", "DETAIL"]);
    for step in items {
        t.add_row(vec![
            step.at.to_rfc3339_opts(SecondsFormat::Millis, true),
            step.step.as_str().to_owned(),
            step.epoch.clone().unwrap_or_default(),
            step.session_id.clone().unwrap_or_default(),
            step.node_id.clone().unwrap_or_default(),
            step_detail(step),
        ]);
    }
    t.trim_fmt()
}

fn step_detail(s: &DeliveryStep) -> String {
    let budget = || {
        format!(
            "attempts {} of {}",
            s.attempts.unwrap_or(0),
            s.attempt_budget.unwrap_or(0)
        )
    };
    match s.step {
        StepKind::Materialized => "a delivery of the event was created".to_owned(),
        StepKind::Leased => s
            .lease_until
            .map(|t| format!("lease until {}", time(&t)))
            .unwrap_or_default(),
        StepKind::LeaseLapsed => format!(
            "no ACK in time: {} ({})",
            s.state.map(|x| x.to_string()).unwrap_or_default(),
            budget()
        ),
        StepKind::AckRefused => {
            "an ACK with a stale proof was refused (DELIVERY_LEASE_LOST)".to_owned()
        }
        StepKind::SessionClosed => format!(
            "the session closed while holding the lease ({} {})",
            s.close_code.map(|c| c.to_string()).unwrap_or_default(),
            printable(s.reason.as_deref().unwrap_or_default())
        ),
        StepKind::Retried => format!(
            "retried by credential {} with +{} attempts ({}): {}",
            s.credential_id.clone().unwrap_or_default(),
            s.additional_attempts.unwrap_or(0),
            budget(),
            printable(s.reason.as_deref().unwrap_or_default())
        ),
        StepKind::Acked => "ACKed".to_owned(),
    }
}

/// `deliveries retry --expired`.
pub fn retry_receipt(r: &RetryReceipt) -> String {
    let range = match (&r.first_sequence, &r.last_sequence) {
        (Some(a), Some(b)) => format!(", sequences {a} to {b}"),
        _ => String::new(),
    };
    let mut text = if r.dry_run {
        format!(
            "Dry run: {} EXPIRED deliveries match{range}; nothing was changed.",
            r.matched
        )
    } else {
        format!(
            "Re-armed {} of {} matching EXPIRED deliveries{range}.",
            r.retried, r.matched
        )
    };
    if r.deduplicated {
        text.push_str(
            "\n(done earlier with this idempotency key: nothing was done now; the original \
             answer is above)",
        );
    }
    text
}

/// `queues list`.
pub fn queues_table(items: &[Queue]) -> String {
    if items.is_empty() {
        return "No queues in this credential's scope.".to_owned();
    }
    let mut t = table(&["ID", "NAME", "HEAD", "RETENTION FLOOR"]);
    for q in items {
        t.add_row(vec![
            q.id.clone(),
            q.name.clone(),
            q.head_sequence.to_string(),
            q.retention_floor.to_string(),
        ]);
    }
    t.trim_fmt()
}
