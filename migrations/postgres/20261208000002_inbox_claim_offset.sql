-- Offsets mode's claim of one record, sent with the BEGIN in one round trip (the store's
-- `begin_and_claim_offset`): moves the partition's next offset past the record when it is at or
-- before it (inserting the row if there is none), or fails with SQLSTATE IBX02 when the record
-- was consumed before, in which case the store begins again and claims the usual way. Either way
-- the row is locked until the transaction ends. Errors like this one appear in the server's log
-- once per record consumed before (a redelivery).
CREATE OR REPLACE FUNCTION inbox_claim_offset(
    p_consumer text, p_topic text, p_partition integer, p_offset bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO inbox_offsets AS o (consumer, topic, partition_id, next_offset)
    VALUES (p_consumer, p_topic, p_partition, p_offset + 1)
    ON CONFLICT (consumer, topic, partition_id) DO UPDATE
        SET next_offset = EXCLUDED.next_offset, updated_at = now()
        WHERE o.next_offset <= p_offset;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'inbox: record consumed before, claimed the usual way (not a failure)'
            USING ERRCODE = 'IBX02';
    END IF;
END
$$;
