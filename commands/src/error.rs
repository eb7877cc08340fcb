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

/// Runs `attempt` until it succeeds, fails for good, or loses the race too often.
pub async fn retrying<T, F, Fut>(what: &str, mut attempt: F) -> Result<T, CommandError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CommandError>>,
{
    for n in 0..8u32 {
        match attempt().await {
            Err(e) if e.is_retryable() => {
                let jitter = rand::random::<u64>() % (2 << n.min(6));
                tokio::time::sleep(std::time::Duration::from_millis(jitter)).await;
            }
            other => return other,
        }
    }
    Err(CommandError::Contention(what.to_string()))
}
