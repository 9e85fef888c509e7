//! The initial schema: every table of delivery-model.md §2 with the indexes
//! that keep each hot query an index range scan.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

const ID_LEN: u32 = 32;

fn id_col<T: IntoIden>(col: T) -> ColumnDef {
    string_len(col, ID_LEN)
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Namespaces::Table)
                    .col(id_col(Namespaces::Id).primary_key())
                    .col(string_len_uniq(Namespaces::Name, 255))
                    .col(big_integer(Namespaces::CreatedAt))
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Applications::Table)
                    .col(id_col(Applications::Id).primary_key())
                    .col(id_col(Applications::NamespaceId))
                    .col(string_len(Applications::Name, 255))
                    .col(big_integer(Applications::CreatedAt))
                    .to_owned(),
            )
            .await?;
        unique_index(
            manager,
            "ux_applications_namespace_name",
            Applications::Table,
            &[Applications::NamespaceId, Applications::Name],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(Credentials::Table)
                    .col(id_col(Credentials::Id).primary_key())
                    .col(id_col(Credentials::NamespaceId))
                    .col(id_col(Credentials::ApplicationId))
                    .col(string_len_uniq(Credentials::TokenDigest, 64))
                    .col(text(Credentials::Permissions))
                    .col(text(Credentials::QueueScope))
                    .col(big_integer_null(Credentials::RevokedAt))
                    .col(big_integer(Credentials::CreatedAt))
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Queues::Table)
                    .col(id_col(Queues::Id).primary_key())
                    .col(id_col(Queues::NamespaceId))
                    .col(string_len(Queues::Name, 255))
                    .col(big_integer(Queues::HeadSequence).default(0))
                    .col(big_integer(Queues::RetentionFloor).default(0))
                    .col(big_integer(Queues::CreatedAt))
                    .to_owned(),
            )
            .await?;
        unique_index(
            manager,
            "ux_queues_namespace_name",
            Queues::Table,
            &[Queues::NamespaceId, Queues::Name],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(ResultEvents::Table)
                    .col(id_col(ResultEvents::Id).primary_key())
                    .col(id_col(ResultEvents::QueueId))
                    .col(big_integer(ResultEvents::Sequence))
                    .col(string_len(ResultEvents::Type, 32))
                    .col(string_len(ResultEvents::AggregateKind, 32))
                    .col(string_len(ResultEvents::AggregateId, ID_LEN))
                    .col(string_len(ResultEvents::AggregateRevision, 20))
                    .col(big_integer(ResultEvents::OccurredAt))
                    .col(text(ResultEvents::Details))
                    .col(text(ResultEvents::Snapshot))
                    .col(big_integer(ResultEvents::AppendedAt))
                    .col(big_integer(ResultEvents::CreatedAt))
                    .to_owned(),
            )
            .await?;
        // Reads after a cursor and the retention purge are range scans here.
        unique_index(
            manager,
            "ux_result_events_queue_sequence",
            ResultEvents::Table,
            &[ResultEvents::QueueId, ResultEvents::Sequence],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(Subscriptions::Table)
                    .col(id_col(Subscriptions::Id).primary_key())
                    .col(id_col(Subscriptions::NamespaceId))
                    .col(id_col(Subscriptions::ApplicationId))
                    .col(id_col(Subscriptions::CredentialId))
                    .col(id_col(Subscriptions::QueueId))
                    .col(string_len(Subscriptions::Name, 128))
                    .col(big_integer(Subscriptions::Revision))
                    .col(boolean(Subscriptions::Enabled))
                    .col(string_len(Subscriptions::Types, 128))
                    .col(big_integer(Subscriptions::CursorSequence))
                    .col(big_integer(Subscriptions::PendingCount))
                    .col(integer(Subscriptions::MaxPending))
                    .col(integer(Subscriptions::MaxAttempts))
                    .col(big_integer(Subscriptions::CreatedAt))
                    .col(big_integer(Subscriptions::UpdatedAt))
                    .to_owned(),
            )
            .await?;
        unique_index(
            manager,
            "ux_subscriptions_namespace_name",
            Subscriptions::Table,
            &[Subscriptions::NamespaceId, Subscriptions::Name],
        )
        .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_subscriptions_credential_queue_created")
                    .table(Subscriptions::Table)
                    .col(Subscriptions::CredentialId)
                    .col(Subscriptions::QueueId)
                    .col((Subscriptions::CreatedAt, IndexOrder::Desc))
                    .col((Subscriptions::Id, IndexOrder::Desc))
                    .to_owned(),
            )
            .await?;
        index(
            manager,
            "ix_subscriptions_queue",
            Subscriptions::Table,
            &[Subscriptions::QueueId],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(Deliveries::Table)
                    .col(id_col(Deliveries::Id).primary_key())
                    .col(id_col(Deliveries::SubscriptionId))
                    .col(id_col(Deliveries::EventId))
                    .col(big_integer(Deliveries::Sequence))
                    .col(big_integer(Deliveries::Revision))
                    .col(string_len(Deliveries::State, 16))
                    .col(big_integer(Deliveries::AvailableAt))
                    .col(big_integer(Deliveries::LeaseEpoch))
                    .col(big_integer_null(Deliveries::LeaseUntil))
                    .col(string_len_null(Deliveries::LeaseDigest, 64))
                    .col(string_len_null(Deliveries::LeaseSessionId, ID_LEN))
                    .col(integer(Deliveries::Attempts))
                    .col(integer(Deliveries::AttemptBudget))
                    .col(big_integer_null(Deliveries::AcknowledgedAt))
                    .col(big_integer(Deliveries::CreatedAt))
                    .to_owned(),
            )
            .await?;
        unique_index(
            manager,
            "ux_deliveries_subscription_event",
            Deliveries::Table,
            &[Deliveries::SubscriptionId, Deliveries::EventId],
        )
        .await?;
        // Claims: PENDING rows of one subscription that are available, in sequence order.
        index(
            manager,
            "ix_deliveries_claim",
            Deliveries::Table,
            &[
                Deliveries::SubscriptionId,
                Deliveries::State,
                Deliveries::AvailableAt,
                Deliveries::Sequence,
            ],
        )
        .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_subscription_created")
                    .table(Deliveries::Table)
                    .col(Deliveries::SubscriptionId)
                    .col((Deliveries::CreatedAt, IndexOrder::Desc))
                    .col((Deliveries::Id, IndexOrder::Desc))
                    .to_owned(),
            )
            .await?;
        index(
            manager,
            "ix_deliveries_session_state",
            Deliveries::Table,
            &[Deliveries::LeaseSessionId, Deliveries::State],
        )
        .await?;
        // Background lease recovery scans LEASED rows by lease_until.
        index(
            manager,
            "ix_deliveries_state_lease_until",
            Deliveries::Table,
            &[Deliveries::State, Deliveries::LeaseUntil],
        )
        .await?;
        // Retention: ACKED rows by age, and "is this event still referenced".
        index(
            manager,
            "ix_deliveries_state_acknowledged",
            Deliveries::Table,
            &[Deliveries::State, Deliveries::AcknowledgedAt],
        )
        .await?;
        index(
            manager,
            "ix_deliveries_event",
            Deliveries::Table,
            &[Deliveries::EventId, Deliveries::State],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(EventSessions::Table)
                    .col(id_col(EventSessions::Id).primary_key())
                    .col(id_col(EventSessions::SubscriptionId))
                    .col(id_col(EventSessions::CredentialId))
                    .col(id_col(EventSessions::ApplicationId))
                    .col(id_col(EventSessions::NodeId))
                    .col(integer(EventSessions::Capacity))
                    .col(big_integer(EventSessions::OpenedAt))
                    .col(big_integer_null(EventSessions::ClosedAt))
                    .col(big_integer(EventSessions::CreatedAt))
                    .to_owned(),
            )
            .await?;
        index(
            manager,
            "ix_event_sessions_closed",
            EventSessions::Table,
            &[EventSessions::ClosedAt],
        )
        .await?;
        index(
            manager,
            "ix_event_sessions_node",
            EventSessions::Table,
            &[EventSessions::NodeId, EventSessions::ClosedAt],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(IdempotencyRecords::Table)
                    .col(id_col(IdempotencyRecords::Id).primary_key())
                    .col(id_col(IdempotencyRecords::CredentialId))
                    .col(string_len(IdempotencyRecords::Key, 255))
                    .col(string_len(IdempotencyRecords::Operation, 64))
                    .col(string_len(IdempotencyRecords::Target, 128))
                    .col(string_len(IdempotencyRecords::RequestDigest, 64))
                    .col(integer(IdempotencyRecords::Status))
                    .col(text(IdempotencyRecords::Response))
                    .col(big_integer(IdempotencyRecords::ExpiresAt))
                    .col(big_integer(IdempotencyRecords::CreatedAt))
                    .to_owned(),
            )
            .await?;
        unique_index(
            manager,
            "ux_idempotency_records_credential_key",
            IdempotencyRecords::Table,
            &[IdempotencyRecords::CredentialId, IdempotencyRecords::Key],
        )
        .await?;
        index(
            manager,
            "ix_idempotency_records_expires",
            IdempotencyRecords::Table,
            &[IdempotencyRecords::ExpiresAt],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(AuditRecords::Table)
                    .col(id_col(AuditRecords::Id).primary_key())
                    .col(id_col(AuditRecords::NamespaceId))
                    .col(id_col(AuditRecords::CredentialId))
                    .col(string_len(AuditRecords::Action, 64))
                    .col(id_col(AuditRecords::TargetId))
                    .col(text_null(AuditRecords::Reason))
                    .col(big_integer_null(AuditRecords::BeforeRevision))
                    .col(big_integer_null(AuditRecords::AfterRevision))
                    .col(big_integer(AuditRecords::At))
                    .col(big_integer(AuditRecords::CreatedAt))
                    .to_owned(),
            )
            .await?;
        index(
            manager,
            "ix_audit_records_target",
            AuditRecords::Table,
            &[AuditRecords::TargetId, AuditRecords::At],
        )
        .await?;

        manager
            .create_table(
                Table::create()
                    .table(SigningKeys::Table)
                    .col(id_col(SigningKeys::Id).primary_key())
                    .col(string_len_uniq(SigningKeys::Purpose, 64))
                    .col(string_len(SigningKeys::Secret, 128))
                    .col(big_integer(SigningKeys::CreatedAt))
                    .to_owned(),
            )
            .await?;

        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            SigningKeys::Table.into_iden(),
            AuditRecords::Table.into_iden(),
            IdempotencyRecords::Table.into_iden(),
            EventSessions::Table.into_iden(),
            Deliveries::Table.into_iden(),
            Subscriptions::Table.into_iden(),
            ResultEvents::Table.into_iden(),
            Queues::Table.into_iden(),
            Credentials::Table.into_iden(),
            Applications::Table.into_iden(),
            Namespaces::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}

async fn index<T: IntoIden + Copy + 'static, C: IntoIden + Copy + 'static>(
    manager: &SchemaManager<'_>,
    name: &str,
    table: T,
    cols: &[C],
) -> Result<(), DbErr> {
    let mut stmt = Index::create();
    stmt.name(name).table(table);
    for col in cols {
        stmt.col(*col);
    }
    manager.create_index(stmt.to_owned()).await
}

async fn unique_index<T: IntoIden + Copy + 'static, C: IntoIden + Copy + 'static>(
    manager: &SchemaManager<'_>,
    name: &str,
    table: T,
    cols: &[C],
) -> Result<(), DbErr> {
    let mut stmt = Index::create();
    stmt.name(name).table(table).unique();
    for col in cols {
        stmt.col(*col);
    }
    manager.create_index(stmt.to_owned()).await
}

#[derive(DeriveIden, Clone, Copy)]
enum Namespaces {
    Table,
    Id,
    Name,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum Applications {
    Table,
    Id,
    NamespaceId,
    Name,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum Credentials {
    Table,
    Id,
    NamespaceId,
    ApplicationId,
    TokenDigest,
    Permissions,
    QueueScope,
    RevokedAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum Queues {
    Table,
    Id,
    NamespaceId,
    Name,
    HeadSequence,
    RetentionFloor,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum ResultEvents {
    Table,
    Id,
    QueueId,
    Sequence,
    Type,
    AggregateKind,
    AggregateId,
    AggregateRevision,
    OccurredAt,
    Details,
    Snapshot,
    AppendedAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum Subscriptions {
    Table,
    Id,
    NamespaceId,
    ApplicationId,
    CredentialId,
    QueueId,
    Name,
    Revision,
    Enabled,
    Types,
    CursorSequence,
    PendingCount,
    MaxPending,
    MaxAttempts,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum Deliveries {
    Table,
    Id,
    SubscriptionId,
    EventId,
    Sequence,
    Revision,
    State,
    AvailableAt,
    LeaseEpoch,
    LeaseUntil,
    LeaseDigest,
    LeaseSessionId,
    Attempts,
    AttemptBudget,
    AcknowledgedAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum EventSessions {
    Table,
    Id,
    SubscriptionId,
    CredentialId,
    ApplicationId,
    NodeId,
    Capacity,
    OpenedAt,
    ClosedAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum IdempotencyRecords {
    Table,
    Id,
    CredentialId,
    Key,
    Operation,
    Target,
    RequestDigest,
    Status,
    Response,
    ExpiresAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum AuditRecords {
    Table,
    Id,
    NamespaceId,
    CredentialId,
    Action,
    TargetId,
    Reason,
    BeforeRevision,
    AfterRevision,
    At,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum SigningKeys {
    Table,
    Id,
    Purpose,
    Secret,
    CreatedAt,
}
