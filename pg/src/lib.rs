//! PostgreSQL server plumbing.
