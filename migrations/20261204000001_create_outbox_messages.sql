-- The transactional outbox: one row per outgoing message, written in the
-- same transaction as the producer's business rows, so it exists iff they
-- committed. A relay publishes the pending rows and marks them published
-- after the broker's confirm.
--
-- Unqualified names and IF NOT EXISTS, as in the inbox's migrations.

CREATE TABLE IF NOT EXISTS outbox_messages (
    -- The producer's message id, published as the AMQP message_id every
    -- time, so the consumers' inboxes discard a re-published copy. The
    -- primary key makes a second enqueue of one id a no-op.
    message_id   UUID         PRIMARY KEY,
    -- Enqueue order: relays take the oldest pending rows first. An
    -- identity, not created_at, because every row of one transaction has
    -- the same now().
    position     BIGINT       GENERATED ALWAYS AS IDENTITY,
    exchange     VARCHAR(255) NOT NULL,
    routing_key  VARCHAR(255) NOT NULL,
    message_type VARCHAR(255) NOT NULL,
    -- Text headers, as a JSON object (readable with psql).
    headers      JSONB        NOT NULL DEFAULT '{}',
    body         BYTEA        NOT NULL,
    created_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    -- Set by the relay after the broker confirmed the publish.
    published_at TIMESTAMPTZ,
    -- A lease, not a held transaction: a relay takes a batch until
    -- locked_until; if it dies, the lease runs out and another relay takes
    -- the rows. Nothing stays open while the relay talks to the broker.
    locked_until TIMESTAMPTZ,
    lease_id     UUID,
    -- How many times a relay took the row.
    attempts     INTEGER      NOT NULL DEFAULT 0
);

-- What the relay scans: pending rows in enqueue order. Partial, so it stays
-- as small as the backlog however many published rows the table keeps.
CREATE INDEX IF NOT EXISTS outbox_messages_pending_idx
    ON outbox_messages (position)
    WHERE published_at IS NULL;

-- What cleanup scans: published rows by age, as the inbox's
-- processed_at index.
CREATE INDEX IF NOT EXISTS outbox_messages_published_at_idx
    ON outbox_messages (published_at)
    WHERE published_at IS NOT NULL;

COMMENT ON TABLE outbox_messages IS
    'Outgoing messages, written in the producer''s business transaction; published by a relay under their message_id, marked published after the broker''s confirm, purged after a retention.';
