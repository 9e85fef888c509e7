//! Times: stored as `i64` microseconds since the Unix epoch (UTC), rendered
//! as RFC 3339 with `Z` (spec: delivery-model.md §2).

use std::fmt;

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Serialize, Serializer};

/// A UTC instant with microsecond precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

/// The current time.
pub fn now() -> Timestamp {
    Timestamp(Utc::now().timestamp_micros())
}

impl Timestamp {
    pub fn micros(self) -> i64 {
        self.0
    }

    /// This instant plus `d` (saturating).
    pub fn plus(self, d: std::time::Duration) -> Timestamp {
        let micros = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(micros))
    }

    /// This instant minus `d` (saturating).
    pub fn minus(self, d: std::time::Duration) -> Timestamp {
        let micros = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(micros))
    }

    /// Parses RFC 3339 (any offset) into UTC. Sub-microsecond digits are
    /// refused rather than silently truncated.
    pub fn parse_rfc3339(s: &str) -> Result<Timestamp, &'static str> {
        let parsed = DateTime::parse_from_rfc3339(s).map_err(|_| "must be an RFC 3339 time")?;
        if parsed.timestamp_subsec_nanos() % 1000 != 0 {
            return Err("must have at most microsecond precision");
        }
        Ok(Timestamp(parsed.with_timezone(&Utc).timestamp_micros()))
    }

    /// RFC 3339 in UTC with `Z`, e.g. `2026-09-17T10:00:00.123456Z`
    /// (fraction omitted when zero).
    pub fn to_rfc3339(self) -> String {
        match DateTime::<Utc>::from_timestamp_micros(self.0) {
            Some(t) => t.to_rfc3339_opts(SecondsFormat::AutoSi, true),
            None => "1970-01-01T00:00:00Z".to_owned(),
        }
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_rfc3339())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_utc_with_z_and_round_trips() {
        let t = Timestamp::parse_rfc3339("2026-09-17T12:00:00.123456+02:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-09-17T10:00:00.123456Z");
        assert_eq!(Timestamp::parse_rfc3339(&t.to_rfc3339()).unwrap(), t);
        let whole = Timestamp::parse_rfc3339("2026-09-17T10:00:00Z").unwrap();
        assert_eq!(whole.to_rfc3339(), "2026-09-17T10:00:00Z");
    }

    #[test]
    fn refuses_nanoseconds_and_garbage() {
        assert!(Timestamp::parse_rfc3339("2026-09-17T10:00:00.123456789Z").is_err());
        assert!(Timestamp::parse_rfc3339("yesterday").is_err());
    }
}
