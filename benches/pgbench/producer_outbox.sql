-- The producer's transaction with its keyed outbox row, as the store writes it (the key's
-- advisory lock, then the row; ON CONFLICT for the send's dedup) (scripts/pgbench-producer).
\set r random(1, 1000000000)
BEGIN;
INSERT INTO bench_parcels (id, tracking_number) VALUES (md5(:r::text || clock_timestamp()::text), 'TRK' || :r);
INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, headers, traceparent) SELECT 'bench-producer', 'parcel-created-' || md5(:r::text || clock_timestamp()::text), md5(:r::text), '\x7b7d'::bytea, '{}'::jsonb, NULL FROM (SELECT pg_advisory_xact_lock(1768842872, hashtext('bench-producer' || chr(1) || md5(:r::text)))) AS key_lock ON CONFLICT (destination, message_id) DO NOTHING RETURNING id;
COMMIT;
