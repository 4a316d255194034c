-- The same statements in the baseline's three round trips (the probe sent with the COMMIT, which
-- sqlx cannot do): what the fourth trip costs, and what the inbox row's write costs.
\set n random(1, 1000000000000000)
SET TRANSACTION ISOLATION LEVEL READ COMMITTED \; SELECT inbox_claim_new('pgbench', :client_id || '-' || :n) \; BEGIN;
INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n, 'booked');
SELECT 1 \; COMMIT;
