//! Subscription names and connection capacity.

/// A subscription name: `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`, unique in the
/// namespace (spec: http-api.md §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionName(String);

impl SubscriptionName {
    pub fn parse(s: &str) -> Option<SubscriptionName> {
        let bytes = s.as_bytes();
        let ok = !bytes.is_empty()
            && bytes.len() <= 128
            && bytes[0].is_ascii_alphanumeric()
            && bytes[1..]
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        ok.then(|| SubscriptionName(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Deliveries a connection may hold at once: 1–32, fixed for the connection
/// (spec: protocol.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity(u32);

impl Capacity {
    pub const MAX: u32 = 32;

    pub fn new(n: u64) -> Option<Capacity> {
        (1..=u64::from(Self::MAX))
            .contains(&n)
            .then_some(Capacity(n as u32))
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_pattern() {
        assert!(SubscriptionName::parse("object-results").is_some());
        assert!(SubscriptionName::parse("a").is_some());
        assert!(SubscriptionName::parse(&"a".repeat(128)).is_some());
        assert!(SubscriptionName::parse(&"a".repeat(129)).is_none());
        assert!(SubscriptionName::parse("-a").is_none());
        assert!(SubscriptionName::parse("a b").is_none());
        assert!(SubscriptionName::parse("").is_none());
        assert!(SubscriptionName::parse("é").is_none());
    }

    #[test]
    fn capacity_is_one_to_thirty_two() {
        assert!(Capacity::new(0).is_none());
        assert!(Capacity::new(1).is_some());
        assert!(Capacity::new(32).is_some());
        assert!(Capacity::new(33).is_none());
    }
}
