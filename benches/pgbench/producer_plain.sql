-- The producer's transaction without the outbox: a parcel row and the commit
-- (scripts/pgbench-producer).
\set r random(1, 1000000000)
BEGIN;
INSERT INTO bench_parcels (id, tracking_number) VALUES (md5(:r::text || clock_timestamp()::text), 'TRK' || :r);
COMMIT;
