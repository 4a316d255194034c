-- Deliveries that began and reached no outcome (the consumer died on them), counted where the
-- broker counts none (Kafka, classic RabbitMQ queues): the crash-loop limit there.
ALTER TABLE inbox_messages ADD COLUMN IF NOT EXISTS unfinished integer NOT NULL DEFAULT 0;
