-- The same claimed by its partition's offset.
\set n random(1, 1000000000000000)
BEGIN;
INSERT INTO inbox_offsets AS o (consumer, topic, partition_id, next_offset) VALUES ('pgbench', 'bench', :client_id, :n) ON CONFLICT (consumer, topic, partition_id) DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now() WHERE o.next_offset <= 9000000000000000000;
INSERT INTO bench_effects (run, message_id, payload) SELECT 'pgbench', :client_id || '-' || :n || '-' || g, 'booked' FROM generate_series(0, #last) g;
SELECT 1;
COMMIT;
