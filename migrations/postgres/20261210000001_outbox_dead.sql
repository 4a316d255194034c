-- Dead rows by id: `inbox outbox dead list`, and the dead half of the relay's gauges, which read
-- only rows not yet published (the claimable rows' index gives the other half), so that their
-- cost follows the backlog and not the published rows kept for retention. Empty while nothing
-- is dead, and a row enters it only when it dies: nothing on the producer's path.
CREATE INDEX IF NOT EXISTS outbox_messages_dead
    ON outbox_messages (id)
    WHERE dead_at IS NOT NULL;
