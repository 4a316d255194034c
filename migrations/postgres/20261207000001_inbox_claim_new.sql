-- The first claim of a message not seen before, sent with the BEGIN in one round trip (the
-- store's `begin_and_claim`): it inserts the claimed row, or fails with SQLSTATE IBX01 when the
-- row exists, in which case the store begins again and claims the usual way. An error is the
-- only answer that statement can give: its results are not read. Errors like this one appear in
-- the server's log once per message seen before (a duplicate, a retry).
CREATE OR REPLACE FUNCTION inbox_claim_new(p_consumer text, p_message_id text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO inbox_messages (consumer, message_id, processed_at)
    VALUES (p_consumer, p_message_id, now())
    ON CONFLICT (consumer, message_id) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox: message seen before, claimed the usual way (not a failure)'
            USING ERRCODE = 'IBX01';
    END IF;
END
$$;
