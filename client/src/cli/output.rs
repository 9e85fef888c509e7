//! Human-readable tables of the admin commands.

use chrono::SecondsFormat;
use comfy_table::{Table, presets};

use crate::{DeliveryDetail, DeliveryState, EventDelivery, ResultType, Subscription, types::Time};

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
