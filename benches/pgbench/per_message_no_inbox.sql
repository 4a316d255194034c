-- The bench's no-inbox baseline: BEGIN, the business write, COMMIT. Three round trips.
\set n random(1, 1000000000000000)
BEGIN;
INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n, 'booked');
COMMIT;
