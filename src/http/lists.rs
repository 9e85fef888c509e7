//! List pages and their cursors, shared by the two list endpoints
//! (spec: http-api.md §3 "List cursors"; decision 0010).

use crate::{
    domain::Principal,
    error::{Error, Result},
    state::AppState,
    store::list_cursor::{self, CursorBinding, ListPosition},
};

/// The binding of a list cursor for this caller.
pub fn binding<'a>(
    principal: &'a Principal,
    endpoint: &'static str,
    parent_id: &'a str,
    state: Option<&'a str>,
) -> CursorBinding<'a> {
    CursorBinding {
        endpoint,
        namespace_id: principal.namespace_id.as_str(),
        credential_id: principal.credential_id.as_str(),
        parent_id,
        state,
    }
}

/// The query-string check of `cursor` (before authentication).
pub fn check_cursor_shape(cursor: Option<&String>) -> Result<()> {
    match cursor {
        Some(c) if !list_cursor::well_formed(c) => Err(invalid_cursor()),
        _ => Ok(()),
    }
}

fn invalid_cursor() -> Error {
    Error::invalid_argument(
        "cursor: not a cursor issued for this list (same endpoint, credential, parent and state filter)",
    )
}

/// The position a `cursor` resumes after; 400 when it was not issued for
/// this binding or was altered.
pub async fn resume_after(
    state: &AppState,
    binding: &CursorBinding<'_>,
    cursor: Option<&String>,
) -> Result<Option<ListPosition>> {
    let Some(cursor) = cursor else {
        return Ok(None);
    };
    let key = list_cursor::load_key(state.db.reader())
        .await?
        .ok_or_else(invalid_cursor)?;
    list_cursor::decode(&key, binding, cursor)
        .map(Some)
        .ok_or_else(invalid_cursor)
}

/// The `next_cursor` of a page: present only when more rows follow.
pub async fn next_cursor(
    state: &AppState,
    binding: &CursorBinding<'_>,
    more: bool,
    last: Option<ListPosition>,
) -> Result<Option<String>> {
    let (true, Some(last)) = (more, last) else {
        return Ok(None);
    };
    let key = list_cursor::ensure_key(&state.db).await?;
    list_cursor::encode(&key, binding, &last)
        .map(Some)
        .ok_or_else(|| Error::internal("could not sign a list cursor"))
}
