-- Labels (SPEC §3.12) on sandboxes and templates, written by their projectors. A `list`
-- filter is `labels @> '{…}'`, served by a GIN index (jsonb_path_ops answers containment).
ALTER TABLE sandboxes ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
ALTER TABLE sandbox_templates ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
CREATE INDEX sandboxes_labels ON sandboxes USING gin (labels jsonb_path_ops);
CREATE INDEX sandbox_templates_labels ON sandbox_templates USING gin (labels jsonb_path_ops);
