-- Offsets mode (Kafka): per consumer and partition, the offset of the next record to handle,
-- written in the same transaction as the handler's writes. The database, not the broker, is the
-- truth of what was consumed; a consumer seeks here when it is assigned a partition.
-- One row per (consumer, topic, partition): no row per message.
CREATE TABLE IF NOT EXISTS inbox_offsets (
    consumer     TEXT        NOT NULL CHECK (octet_length(consumer) BETWEEN 1 AND 100),
    topic        TEXT        NOT NULL CHECK (octet_length(topic) BETWEEN 1 AND 255),
    partition_id INTEGER     NOT NULL CHECK (partition_id >= 0),
    next_offset  BIGINT      NOT NULL CHECK (next_offset >= 0),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition_id)
);
