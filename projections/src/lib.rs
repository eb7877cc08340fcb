//! Projectors turn events into rows. Inline projectors run inside a command's transaction;
//! async ones follow the log from a checkpoint. Both are deterministic functions of the event
//! and their own tables, so every projection can be rebuilt from the log and compared.
//!
//! Nothing outside this crate writes a projection table.
