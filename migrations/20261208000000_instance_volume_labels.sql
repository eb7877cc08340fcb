-- Labels (SPEC §3.12) on instances and volumes. Their rows' documents already hold them
-- (`doc->'labels'`, absent when there are none); the column is derived from the document, so
-- no projector writes it. A `list` filter is `labels @> '{…}'`, served by a GIN index.
ALTER TABLE instances
    ADD COLUMN labels jsonb NOT NULL GENERATED ALWAYS AS (COALESCE(doc->'labels', '{}'::jsonb)) STORED;
ALTER TABLE sandbox_volumes
    ADD COLUMN labels jsonb NOT NULL GENERATED ALWAYS AS (COALESCE(doc->'labels', '{}'::jsonb)) STORED;
CREATE INDEX instances_labels ON instances USING gin (labels jsonb_path_ops);
CREATE INDEX sandbox_volumes_labels ON sandbox_volumes USING gin (labels jsonb_path_ops);
-- Each usage record carries its resource's labels, so usage groups by a label key.
ALTER TABLE usage_records ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
