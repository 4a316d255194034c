-- The inbox: one narrow row per (consumer, message). No payload.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         text        NOT NULL CHECK (octet_length(consumer) BETWEEN 1 AND 100),
    message_id       text        NOT NULL CHECK (octet_length(message_id) BETWEEN 1 AND 255),
    received_at      timestamptz NOT NULL DEFAULT now(),
    -- Set by the claim, committed with the handler's writes; NULL until done.
    processed_at     timestamptz,
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error       text,
    dead_lettered_at timestamptz,
    -- consumer first: per-consumer stats and dead-letter listings scan one key range.
    PRIMARY KEY (consumer, message_id)
);

-- Cleanup deletes processed rows by age.
CREATE INDEX IF NOT EXISTS inbox_messages_processed_at
    ON inbox_messages (processed_at)
    WHERE processed_at IS NOT NULL;

-- Inspection of what is failing or dead: a small set, kept small by a partial index.
CREATE INDEX IF NOT EXISTS inbox_messages_unprocessed
    ON inbox_messages (consumer, received_at)
    WHERE processed_at IS NULL;
