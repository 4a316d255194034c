-- The inbox: one narrow row per (consumer, message). No payload.
-- Timestamps are UTC ISO-8601 text with milliseconds, which sorts chronologically.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         TEXT    NOT NULL CHECK (length(CAST(consumer AS BLOB)) BETWEEN 1 AND 100),
    message_id       TEXT    NOT NULL CHECK (length(CAST(message_id AS BLOB)) BETWEEN 1 AND 255),
    received_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    processed_at     TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       TEXT,
    dead_lettered_at TEXT,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX IF NOT EXISTS inbox_messages_processed_at
    ON inbox_messages (processed_at)
    WHERE processed_at IS NOT NULL;

CREATE INDEX IF NOT EXISTS inbox_messages_unprocessed
    ON inbox_messages (consumer, received_at)
    WHERE processed_at IS NULL;
