-- Dead rows by id: `inbox outbox dead list`, and the dead half of the relay's gauges, which read
-- only rows not yet published (the claimable rows' index gives the other half), so that their
-- cost follows the backlog and not the published rows kept for retention. Kept up to date at no
-- cost to the producer: a row enters it only when it dies.
-- Building it reads the whole table, kept rows included, under a lock that blocks writes to the
-- outbox meanwhile (as `outbox_messages_claimable`'s did). On a large table, create it first by
-- hand, without that lock:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_dead
--       ON outbox_messages (id) WHERE dead_at IS NOT NULL;
-- and this migration then finds it there.
CREATE INDEX IF NOT EXISTS outbox_messages_dead
    ON outbox_messages (id)
    WHERE dead_at IS NOT NULL;
