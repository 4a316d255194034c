-- A batch of 64 (PostgreSQL's savepoint cache) claimed by id in one statement, a savepoint and a write per message.
\set n random(1, 1000000000000000)
BEGIN;
INSERT INTO inbox_messages (consumer, message_id, processed_at) SELECT 'pgbench', id, now() FROM (SELECT :client_id || '-' || :n || '-' || g AS id FROM generate_series(0, #last) g) t ORDER BY id ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = now() WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL RETURNING message_id, attempts, last_error;
-- EACH MESSAGE (scripts/pgbench-shapes writes the next line out for each message, # its number)
SAVEPOINT s; INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n || '-#', 'booked');
SELECT 1;
COMMIT;
