-- The inbox: one narrow row per (consumer, message). No payload. MySQL 8.0.16+ and MariaDB 10.6+.
-- Ids are VARBINARY, compared byte for byte: 'a', 'A' and 'a ' are three messages (a _bin
-- collation would still ignore trailing spaces on MariaDB). Timestamps are UTC (UTC_TIMESTAMP,
-- whatever the session's time zone), with microseconds.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         VARBINARY(100) NOT NULL,
    message_id       VARBINARY(255) NOT NULL,
    received_at      DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- Set by the claim, committed with the handler's writes; NULL until done.
    processed_at     DATETIME(6)    NULL,
    attempts         INT            NOT NULL DEFAULT 0,
    last_error       TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci NULL,
    dead_lettered_at DATETIME(6)    NULL,
    -- Deliveries that began and reached no outcome (the consumer died on them), counted where the
    -- broker counts none (Kafka, classic RabbitMQ queues): the crash-loop limit there.
    unfinished       INT            NOT NULL DEFAULT 0,
    -- consumer first: per-consumer stats and dead-letter listings scan one key range.
    PRIMARY KEY (consumer, message_id),
    -- Cleanup deletes processed rows by age (no partial indexes here: NULLs sort first).
    KEY inbox_messages_processed_at (processed_at),
    -- Inspection of what is failing or dead.
    KEY inbox_messages_unprocessed (consumer, received_at),
    CONSTRAINT inbox_messages_consumer_length CHECK (OCTET_LENGTH(consumer) BETWEEN 1 AND 100),
    CONSTRAINT inbox_messages_id_length CHECK (OCTET_LENGTH(message_id) BETWEEN 1 AND 255),
    CONSTRAINT inbox_messages_attempts CHECK (attempts >= 0)
) ENGINE = InnoDB;
