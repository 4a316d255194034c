-- The outbox: messages written in the application's transaction, published by the relay after
-- the commit. Column names avoid words reserved in PostgreSQL, MySQL or SQLite.
CREATE TABLE IF NOT EXISTS outbox_messages (
    -- The row id (what `inbox outbox dead retry|skip` take). Within an ordering key, rows are
    -- published in id order; writers of one key take a transaction-scoped lock before the id,
    -- so id order is their commit order. (That needs the identity's default CACHE 1: a cache
    -- hands each session a range of its own, and ids would no longer follow the lock.)
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination  text        NOT NULL CHECK (octet_length(destination) BETWEEN 1 AND 255),
    message_id   text        NOT NULL CHECK (octet_length(message_id) BETWEEN 1 AND 255),
    -- NULL: unordered. The same key a partitioning transport (Kafka) partitions by.
    ordering_key text        CHECK (octet_length(ordering_key) BETWEEN 1 AND 255),
    payload      bytea       NOT NULL,
    -- Header name to value: a JSON string for UTF-8 values, {"hex": "…"} for others.
    headers      jsonb       NOT NULL DEFAULT '{}',
    traceparent  text,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Not published before this (a failed row's backoff).
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts     integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- Of those, the publishes that found no route (no queue bound, no topic): they have a limit
    -- of their own, which an outage's failures must not use up.
    no_routes    integer     NOT NULL DEFAULT 0 CHECK (no_routes >= 0),
    last_error   text,
    -- The relay batch that holds the row, until `lease_until`; a mark must name it (fencing).
    lease_token  uuid,
    lease_until  timestamptz,
    published_at timestamptz,
    dead_at      timestamptz,
    UNIQUE (destination, message_id)
);

-- The relay's claim: pending rows in id order.
CREATE INDEX IF NOT EXISTS outbox_messages_pending
    ON outbox_messages (id)
    WHERE published_at IS NULL;

-- The claim's "no earlier pending row of this key" check, and blocked keys in `outbox stats`.
CREATE INDEX IF NOT EXISTS outbox_messages_pending_keys
    ON outbox_messages (destination, ordering_key, id)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;

-- Retention: published rows by age.
CREATE INDEX IF NOT EXISTS outbox_messages_published_at
    ON outbox_messages (published_at)
    WHERE published_at IS NOT NULL;
