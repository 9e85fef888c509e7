//! The four terminal result types and subscription type sets
//! (spec: delivery-model.md §3, §4).

pub use orbit_events_wire::ResultType;

/// The bit of a result type in a [`TypeSet`].
fn bit(t: ResultType) -> u8 {
    1 << (t as u8)
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
            if bits & bit(*t) != 0 {
                return Err(format!("types: {t} is listed twice"));
            }
            bits |= bit(*t);
        }
        Ok(TypeSet(bits))
    }

    pub fn contains(self, t: ResultType) -> bool {
        self.0 & bit(t) != 0
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
            .fold(0u8, |acc, t| acc | bit(t));
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
