-- A spec served from a replica's copy reads only the node's entries written after the
-- generation the copy was read at: through this index, not a scan of the node's entries.
CREATE INDEX node_spec_entries_recent ON node_spec_entries (node_id, generation);
