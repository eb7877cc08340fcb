-- The transaction that freed each address (the pool's range set, or the instance's release).
-- The log orders events by transaction id, not by commit, so a transaction whose id is older
-- than the release must not lease the address: replayed, its lease would come before the
-- release, with the address still held. A claim takes only rows freed by an older transaction
-- (`freed_by < pg_current_xact_id()`); the first claim of a transaction gets its id then, after
-- every release it can see committed, so this only holds back a later claim of a transaction
-- against releases that committed after it started writing.
ALTER TABLE ip_free ADD COLUMN freed_by xid8 NOT NULL DEFAULT pg_current_xact_id();
