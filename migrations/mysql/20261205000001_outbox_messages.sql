-- The outbox: messages written in the application's transaction, published by the relay after
-- the commit. Column names avoid words reserved in PostgreSQL, MySQL or SQLite.
CREATE TABLE IF NOT EXISTS outbox_messages (
    -- The row id (what `inbox outbox dead retry|skip` take). Within an ordering key, rows are
    -- published in id order; writers of one key lock the key's row in outbox_keys before they
    -- take an id, so id order is their commit order.
    id           BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    destination  VARBINARY(255) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    -- NULL: unordered. The same key a partitioning transport (Kafka) partitions by.
    ordering_key VARBINARY(255) NULL,
    payload      LONGBLOB       NOT NULL,
    -- Header name to value: a JSON string for UTF-8 values, {"hex": "…"} for others.
    headers      LONGTEXT       CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci NOT NULL DEFAULT ('{}'),
    traceparent  VARCHAR(255)   CHARACTER SET ascii NULL,
    created_at   DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- Not published before this (a failed row's backoff).
    available_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempts     INT            NOT NULL DEFAULT 0,
    -- Of those, the publishes that found no route (no queue bound, no topic).
    no_routes    INT            NOT NULL DEFAULT 0,
    last_error   TEXT           CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci NULL,
    -- The relay batch that holds the row, until `lease_until`; a mark must name it (fencing).
    lease_token  CHAR(36)       CHARACTER SET ascii NULL,
    lease_until  DATETIME(6)    NULL,
    published_at DATETIME(6)    NULL,
    dead_at      DATETIME(6)    NULL,
    UNIQUE KEY outbox_messages_message (destination, message_id),
    -- The relay's claim (pending rows in id order) and retention (published rows by age).
    KEY outbox_messages_pending (published_at, id),
    -- The claim's "no earlier pending row of this key" check, and blocked keys in `outbox stats`.
    KEY outbox_messages_pending_keys (destination, ordering_key, published_at, id),
    CONSTRAINT outbox_messages_destination_length CHECK (OCTET_LENGTH(destination) BETWEEN 1 AND 255),
    CONSTRAINT outbox_messages_id_length CHECK (OCTET_LENGTH(message_id) BETWEEN 1 AND 255),
    CONSTRAINT outbox_messages_key_length CHECK (OCTET_LENGTH(ordering_key) BETWEEN 1 AND 255),
    CONSTRAINT outbox_messages_attempts CHECK (attempts >= 0 AND no_routes >= 0)
) ENGINE = InnoDB;

-- One row per ordering key, used only as a lock: a writer of a keyed row locks it (inserting it
-- if new) before the outbox row takes its id, for the rest of its transaction. Rows here carry
-- no state, so deleting them is always safe; the relay's retention deletes those whose key has
-- no pending row.
CREATE TABLE IF NOT EXISTS outbox_keys (
    destination  VARBINARY(255) NOT NULL,
    ordering_key VARBINARY(255) NOT NULL,
    PRIMARY KEY (destination, ordering_key)
) ENGINE = InnoDB;
