-- Offsets mode (Kafka): per consumer and partition, the offset of the next record to handle,
-- written in the same transaction as the handler's writes. The database, not the broker, is the
-- truth of what was consumed; a consumer seeks here when it is assigned a partition.
-- One row per (consumer, topic, partition): no row per message.
CREATE TABLE IF NOT EXISTS inbox_offsets (
    consumer     VARBINARY(100) NOT NULL,
    topic        VARBINARY(255) NOT NULL,
    partition_id INT            NOT NULL,
    next_offset  BIGINT         NOT NULL,
    updated_at   DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, topic, partition_id),
    CONSTRAINT inbox_offsets_partition CHECK (partition_id >= 0),
    CONSTRAINT inbox_offsets_next CHECK (next_offset >= 0)
) ENGINE = InnoDB;
