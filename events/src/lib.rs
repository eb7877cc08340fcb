//! The event log.
