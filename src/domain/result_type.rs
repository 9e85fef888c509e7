//! The four terminal result types and subscription type sets
//! (spec: delivery-model.md §3, §4).

use std::fmt;

/// A terminal task result type. `task.requeued` is not a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResultType {
    Cancelled,
    Failed,
    NeedsReview,
    Succeeded,
}

impl ResultType {
    /// All four, in the canonical (alphabetical) order.
    pub const ALL: [ResultType; 4] = [
        ResultType::Cancelled,
        ResultType::Failed,
        ResultType::NeedsReview,
        ResultType::Succeeded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ResultType::Cancelled => "task.cancelled",
            ResultType::Failed => "task.failed",
            ResultType::NeedsReview => "task.needs_review",
            ResultType::Succeeded => "task.succeeded",
        }
    }

    pub fn parse(s: &str) -> Option<ResultType> {
        ResultType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The task `state` a snapshot of this result type must carry.
    pub fn snapshot_state(self) -> &'static str {
        match self {
            ResultType::Cancelled => "CANCELLED",
            ResultType::Failed => "FAILED",
            ResultType::NeedsReview => "NEEDS_REVIEW",
            ResultType::Succeeded => "SUCCEEDED",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for ResultType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A non-empty set of result types; "all four" when a request omits `types`
/// or sends `[]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TypeSet(u8);

impl TypeSet {
    pub const ALL: TypeSet = TypeSet(0b1111);

    /// Builds a set from a request list: `[]` means all; a repeated type is
    /// an error naming it.
    pub fn from_list(types: &[ResultType]) -> Result<TypeSet, String> {
        if types.is_empty() {
            return Ok(TypeSet::ALL);
        }
        let mut bits = 0u8;
        for t in types {
            if bits & t.bit() != 0 {
                return Err(format!("types: {t} is listed twice"));
            }
            bits |= t.bit();
        }
        Ok(TypeSet(bits))
    }

    pub fn contains(self, t: ResultType) -> bool {
        self.0 & t.bit() != 0
    }

    /// The members in canonical order.
    pub fn to_vec(self) -> Vec<ResultType> {
        ResultType::ALL
            .into_iter()
            .filter(|t| self.contains(*t))
            .collect()
    }

    /// Storage form: canonical, comma-separated.
    pub fn to_db(self) -> String {
        self.to_vec()
            .iter()
            .map(|t| t.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Reads the storage form; unknown names are ignored (never written).
    pub fn from_db(s: &str) -> TypeSet {
        let bits = s
            .split(',')
            .filter_map(ResultType::parse)
            .fold(0u8, |acc, t| acc | t.bit());
        TypeSet(bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_normalize_to_canonical_order() {
        let set = TypeSet::from_list(&[ResultType::Succeeded, ResultType::Cancelled]).unwrap();
        assert_eq!(set.to_db(), "task.cancelled,task.succeeded");
        assert_eq!(TypeSet::from_db(&set.to_db()), set);
        assert_eq!(TypeSet::from_list(&[]).unwrap(), TypeSet::ALL);
        assert!(TypeSet::from_list(&[ResultType::Failed, ResultType::Failed]).is_err());
    }
}
