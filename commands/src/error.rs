//! What a command can fail with.

use vps_domain::DomainError;
use vps_events::AppendError;
use vps_projections::ProjectionError;

/// A failed command. Domain facts are for the caller; the rest are internal.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The decision refused (bad input, not found, invalid state, quota…).
    #[error(transparent)]
    Domain(#[from] DomainError),
    /// Someone else changed the stream first, too many times in a row.
    #[error("too much contention on {0}; try again")]
    Contention(String),
    /// A concurrent command took what this one booked (e.g. the room on a node): decide again.
    #[error("{0}")]
    Raced(String),
    /// The log refused the append for another reason.
    #[error(transparent)]
    Append(AppendError),
    /// A projector failed.
    #[error(transparent)]
    Projection(#[from] ProjectionError),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<AppendError> for CommandError {
    fn from(e: AppendError) -> Self {
        match e {
            AppendError::Database(d) => CommandError::Database(d),
            other => CommandError::Append(other),
        }
    }
}

impl CommandError {
    /// `NOT_FOUND`: `what` (`sandbox sbx_…`) does not exist.
    pub fn not_found(what: impl Into<String>) -> Self {
        CommandError::Domain(DomainError::NotFound { what: what.into() })
    }

    /// Whether loading, deciding and appending again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            CommandError::Append(AppendError::Concurrency { .. }) | CommandError::Raced(_) => true,
            CommandError::Database(sqlx::Error::Database(db))
            | CommandError::Projection(ProjectionError::Database(sqlx::Error::Database(db))) => {
                // Unique violations from racing inserts (a lease, an allocation) and
                // serialization failures: the loser decides again on fresh facts.
                matches!(
                    db.code().as_deref(),
                    Some("23505") | Some("40001") | Some("40P01")
                )
            }
            _ => false,
        }
    }
}
