-- The outbox: messages written in the application's transaction, published by the relay after
-- the commit. Timestamps are UTC ISO-8601 text with milliseconds, as in inbox_messages.
CREATE TABLE IF NOT EXISTS outbox_messages (
    -- AUTOINCREMENT: ids never reused. SQLite runs one writer at a time, so id order is commit
    -- order, and within an ordering key rows are published in id order.
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    destination  TEXT    NOT NULL CHECK (length(CAST(destination AS BLOB)) BETWEEN 1 AND 255),
    message_id   TEXT    NOT NULL CHECK (length(CAST(message_id AS BLOB)) BETWEEN 1 AND 255),
    ordering_key TEXT    CHECK (length(CAST(ordering_key AS BLOB)) BETWEEN 1 AND 255),
    payload      BLOB    NOT NULL,
    headers      TEXT    NOT NULL DEFAULT '{}',
    traceparent  TEXT,
    created_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    available_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    attempts     INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    no_routes    INTEGER NOT NULL DEFAULT 0 CHECK (no_routes >= 0),
    last_error   TEXT,
    lease_token  TEXT,
    lease_until  TEXT,
    published_at TEXT,
    dead_at      TEXT,
    UNIQUE (destination, message_id)
);

CREATE INDEX IF NOT EXISTS outbox_messages_pending
    ON outbox_messages (id)
    WHERE published_at IS NULL;

CREATE INDEX IF NOT EXISTS outbox_messages_pending_keys
    ON outbox_messages (destination, ordering_key, id)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;

CREATE INDEX IF NOT EXISTS outbox_messages_published_at
    ON outbox_messages (published_at)
    WHERE published_at IS NOT NULL;
