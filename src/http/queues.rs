//! `GET /v1/queues` (issue 19, http-api.md "Queues"): the queues of the
//! credential's scope, so an id can be learned again without minting a new
//! credential.

use actix_web::{HttpRequest, HttpResponse, http::StatusCode, web};
use entity::queue;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
use serde::Serialize;
use utoipa::ToSchema;

use crate::{
    auth::{self, Require},
    domain::Permission,
    domain::schema::{Id, Uint64String},
    error::Result,
    http::{envelope::respond, openapi::Envelope, request::no_query},
    state::AppState,
};

/// A queue as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Queue)]
pub struct QueueView {
    #[schema(value_type = Id)]
    pub id: String,
    pub name: String,
    /// The committed head of the queue's result log.
    #[schema(value_type = Uint64String)]
    pub head_sequence: String,
    /// Highest purged sequence (the earliest still readable is this + 1).
    #[schema(value_type = Uint64String)]
    pub retention_floor: String,
}

/// `data` of `GET /v1/queues`: every queue of the scope, by name.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = QueueList)]
pub struct Queues {
    pub items: Vec<QueueView>,
}

/// `GET /v1/queues` (events:read): the credential's queue scope, by name
/// (a scope is a short list; no paging).
#[utoipa::path(
    get,
    path = "/v1/queues",
    tag = "queues",
    operation_id = "listQueues",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The queues of the credential's scope", body = Envelope<Queues>),
    )
)]
pub async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse> {
    no_query(&req)?;
    let principal = auth::authenticate(&req, &state.db).await?;
    principal.require(Permission::EventsRead)?;
    let items = if principal.queue_scope.is_empty() {
        Vec::new()
    } else {
        queue::Entity::find()
            .filter(queue::Column::Id.is_in(principal.queue_scope.iter().map(|q| q.as_str())))
            .filter(queue::Column::NamespaceId.eq(principal.namespace_id.as_str()))
            .order_by_asc(queue::Column::Name)
            .order_by_asc(queue::Column::Id)
            .all(state.db.reader())
            .await?
            .into_iter()
            .map(|q| QueueView {
                id: q.id,
                name: q.name,
                head_sequence: q.head_sequence.to_string(),
                retention_floor: q.retention_floor.to_string(),
            })
            .collect()
    };
    Ok(respond(&req, StatusCode::OK, Queues { items }))
}
