-- The relay's claim reads pending rows that are not dead, in id order, by an index that holds
-- just those. Replaces `outbox_messages_pending` (pending rows, dead ones included), which had
-- two costs: every claim stepped over the dead rows at its front, and the claim's "no earlier
-- pending row of this key" check could use it too (`id < …` with a filter on the key), which
-- under the statistics of an empty table — what autovacuum sees on a queue table — the planner
-- sometimes chose, reading every pending row ahead of each candidate. That check has no
-- `dead_at` condition (a dead head holds its key back), so it cannot use this index and keeps
-- to `outbox_messages_pending_keys`.
-- A plain CREATE INDEX: it blocks writes to the outbox for as long as it takes to index the
-- pending rows, which on a relayed outbox are few.
CREATE INDEX IF NOT EXISTS outbox_messages_claimable
    ON outbox_messages (id)
    WHERE published_at IS NULL AND dead_at IS NULL;

DROP INDEX IF EXISTS outbox_messages_pending;
