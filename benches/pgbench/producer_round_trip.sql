-- The producer's transaction with one round trip more and no work in it: what the outbox's
-- statement costs before its row (scripts/pgbench-producer).
\set r random(1, 1000000000)
BEGIN;
INSERT INTO bench_parcels (id, tracking_number) VALUES (md5(:r::text || clock_timestamp()::text), 'TRK' || :r);
SELECT 1;
COMMIT;
