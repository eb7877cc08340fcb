-- The transaction that freed each address (the pool's range set, or the instance's release).
-- The log orders events by transaction id, not by commit, so a transaction whose id is older
-- than the release must not lease the address: replayed, its lease would come before the
-- release, with the address still held. A claim in a transaction that has an id takes only
-- rows freed by an older one (`freed_by < pg_current_xact_id_if_assigned()`); a transaction
-- without an id yet gets one after every release it can see committed, so it takes any row.
-- (`pg_current_xact_id()` would give the transaction its id when the claim is planned, which
-- a read that must come before the transaction's id cannot afford.)
ALTER TABLE ip_free ADD COLUMN freed_by xid8 NOT NULL DEFAULT pg_current_xact_id();
