//! The event log: event records, the PostgreSQL append-only `events` table (sqlx), and the
//! machinery around it: reading streams and the whole log, durable followers, wake-ups and the
//! tamper-evidence hash chain.
//!
//! Modules: `model` (records, cursors, expected versions), `db` (pools, migrations), `append`,
//! `read`, `notify` (wake-ups), `tail` (one shared read of the newest events), `follower` (named, durable, ordered readers), `chain` (the
//! chainer and `audit verify`).
//!
//! This crate never updates or deletes an event row, and never lets a follower read past the
//! transaction-id horizon: a reader skipping a late commit would lose an event for good.

pub mod append;
pub mod chain;
pub mod db;
pub mod envelope;
pub mod follower;
pub mod lease;
pub mod model;
pub mod notify;
pub mod pattern;
pub mod read;
pub mod tail;

pub use append::{append, append_new_streams, append_unseen, AppendError};
pub use db::{connect, migrate, DbOptions};
pub use follower::Follower;
pub use model::{Cursor, ExpectedVersion, Metadata, NewEvent, RecordedEvent};
pub use notify::Notifier;
