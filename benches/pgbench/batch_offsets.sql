-- The same batch claimed by its partition's offset (Dedup::Offsets): one conditional upsert.
\set n random(1, 1000000000000000)
BEGIN;
INSERT INTO inbox_offsets AS o (consumer, topic, partition_id, next_offset) VALUES ('pgbench', 'bench', :client_id, :n) ON CONFLICT (consumer, topic, partition_id) DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now() WHERE o.next_offset <= 9000000000000000000;
-- EACH MESSAGE (scripts/pgbench-shapes writes the next line out for each message, # its number)
SAVEPOINT s; INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n || '-#', 'booked');
SELECT 1;
COMMIT;
