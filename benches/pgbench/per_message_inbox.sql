-- The inbox per message on PostgreSQL, statement for statement: the claim sent with the BEGIN
-- (one trip), the handler's write, the commit's liveness probe, COMMIT. Four round trips.
\set n random(1, 1000000000000000)
SET TRANSACTION ISOLATION LEVEL READ COMMITTED \; SELECT inbox_claim_new('pgbench', :client_id || '-' || :n) \; BEGIN;
INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n, 'booked');
SELECT 1;
COMMIT;
