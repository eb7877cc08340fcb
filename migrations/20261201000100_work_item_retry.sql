-- Fenced work-item leases and the provider retry time on the item itself.
--
-- Every take draws a fresh `lease_id` from one sequence (never reused, even after an item is
-- deleted and woken again), and completing, rescheduling or failing an item applies only while
-- the row still carries the taker's `lease_id`: a holder whose lease ran out and was retaken
-- changes nothing.
--
-- `retry_at` is the earliest time a provider reconciler may call again after a failed call
-- (it honours `Retry-After`); it survives restarts and is shared by replicas.
CREATE SEQUENCE work_item_leases;

ALTER TABLE work_items
    ADD COLUMN lease_id bigint,
    ADD COLUMN retry_at timestamptz;
