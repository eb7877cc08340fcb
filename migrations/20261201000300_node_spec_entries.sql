-- NodeSpecs kept one entry per placed instance, so an instance's event rewrites its own entry
-- instead of the node's whole spec; node_specs keeps only the generation hosts long-poll on.
CREATE TABLE node_spec_entries (
    node_id     text  NOT NULL,
    instance_id text  NOT NULL,
    entry       jsonb NOT NULL,
    PRIMARY KEY (node_id, instance_id)
);
CREATE INDEX node_spec_entries_instance ON node_spec_entries (instance_id);

INSERT INTO node_spec_entries (node_id, instance_id, entry)
SELECT s.node_id, e->>'id', e FROM node_specs s, jsonb_array_elements(s.spec->'instances') e;

ALTER TABLE node_specs DROP COLUMN spec;
