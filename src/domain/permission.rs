//! Credential permissions (spec: http-api.md §1).

/// One action a credential may be granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Permission {
    EventsManage,
    EventsRead,
    EventsConsume,
    ResultsPublish,
}

impl Permission {
    pub const ALL: [Permission; 4] = [
        Permission::EventsManage,
        Permission::EventsRead,
        Permission::EventsConsume,
        Permission::ResultsPublish,
    ];

    /// The three `events:*` actions `bootstrap --event-access` grants.
    pub const EVENT_ACCESS: [Permission; 3] = [
        Permission::EventsManage,
        Permission::EventsRead,
        Permission::EventsConsume,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Permission::EventsManage => "events:manage",
            Permission::EventsRead => "events:read",
            Permission::EventsConsume => "events:consume",
            Permission::ResultsPublish => "results:publish",
        }
    }

    pub fn parse(s: &str) -> Option<Permission> {
        Permission::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// The permissions of one credential. No permission implies another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PermissionSet(Vec<Permission>);

impl PermissionSet {
    pub fn new(mut perms: Vec<Permission>) -> PermissionSet {
        perms.dedup();
        PermissionSet(perms)
    }

    pub fn contains(&self, p: Permission) -> bool {
        self.0.contains(&p)
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|p| p.as_str()).collect()
    }
}
