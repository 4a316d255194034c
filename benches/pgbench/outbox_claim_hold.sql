-- The outbox relay's statements on PostgreSQL, without the relay: claim a batch of 500 (the
-- relay's claim, locked with SKIP LOCKED), hold it for :hold seconds (the publishes and their
-- confirms), delete it (the mark), commit. scripts/pgbench-outbox-claims runs it with 1, 2 and
-- 4 clients, as the relay runs 1, 2 and 4 batches in flight.
BEGIN;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
SELECT min(id) AS lo, max(id) AS hi FROM (
  SELECT c.id FROM outbox_messages c
  WHERE c.published_at IS NULL AND c.dead_at IS NULL
    AND c.available_at <= clock_timestamp()
    AND (c.ordering_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM outbox_messages e
      WHERE e.destination = c.destination AND e.ordering_key = c.ordering_key
        AND e.published_at IS NULL AND e.id < c.id))
  ORDER BY c.id LIMIT 500 FOR UPDATE SKIP LOCKED) AS claimed \gset
SELECT pg_sleep(:hold);
-- The rows between lo and hi that this transaction holds (the others' are skipped).
DELETE FROM outbox_messages WHERE id IN (
  SELECT id FROM outbox_messages WHERE id BETWEEN :lo AND :hi FOR UPDATE SKIP LOCKED);
COMMIT;
