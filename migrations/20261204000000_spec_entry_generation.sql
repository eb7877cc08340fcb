-- The node generation at which each spec entry was last written: a server holding a node's
-- spec reads again only the entries written since the generation it holds. Counts changes,
-- like node_specs.generation, so a replay does not compare it. Volume entries carry it too:
-- both tables share one writer (spec_entries::write), though specs read volumes whole.
ALTER TABLE node_spec_entries ADD COLUMN generation bigint NOT NULL DEFAULT 0;
ALTER TABLE node_spec_volumes ADD COLUMN generation bigint NOT NULL DEFAULT 0;
