-- A sandbox list filtered by a label alone walks the listing index in order and checks the
-- label (and the state) in the index itself, an index-only scan, instead of visiting the heap
-- page of every row that carries the label and sorting them: at 100,000 sandboxes with a label
-- on 1 % of them, about 1.8 ms against 5. The planner takes the old bitmap of the labels' GIN
-- index while the table's pages are not yet marked all-visible by a vacuum.
DROP INDEX sandboxes_listing;
CREATE INDEX sandboxes_listing ON sandboxes (tenant_id, created_at DESC, id DESC)
    INCLUDE (state, labels);
