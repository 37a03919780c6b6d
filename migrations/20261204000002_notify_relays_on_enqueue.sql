-- Wakes the relays: every statement that inserts outgoing rows sends a
-- NOTIFY on the schema's outbox channel, which PostgreSQL delivers only when
-- the transaction commits (and drops on rollback), and only once per
-- transaction however many rows it enqueued. A relay that LISTENs publishes
-- within a round trip instead of a poll interval; polling remains its
-- fallback, so a lost notification only costs latency.
--
-- The channel is 'outbox_' followed by the schema's name, cut to
-- PostgreSQL's 63-byte limit (inbox_postgres::outbox_channel names it for
-- the listeners). Idempotent: CREATE OR REPLACE.

CREATE OR REPLACE FUNCTION outbox_notify_relays() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left('outbox_' || TG_TABLE_SCHEMA, 63), '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER outbox_notify_relays
    AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_relays();
