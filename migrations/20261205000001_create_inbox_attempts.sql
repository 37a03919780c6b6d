-- The attempt ledger: how often each (message, consumer) failed, its last
-- error, and whether it was dead-lettered. The service's own poison count,
-- because the broker's is not dependable: RabbitMQ 4.3 stopped counting
-- basic.nack in a quorum queue's x-delivery-count, and classic queues and
-- other brokers count nothing at all.
--
-- Written outside the handler's transaction (one autocommit upsert per
-- failed delivery), because that transaction has rolled back: a count kept
-- in it would vanish with it. A separate table, so that a failing message's
-- count never touches, waits for or locks the inbox row its claim takes.
--
-- Unqualified names and IF NOT EXISTS, as in the other migrations.

CREATE TABLE IF NOT EXISTS inbox_attempts (
    message_id      UUID          NOT NULL,
    consumer        VARCHAR(500)  NOT NULL,
    -- Failed deliveries since the first (or since the message was last
    -- dead-lettered: a replayed dead message starts a fresh count).
    attempts        INTEGER       NOT NULL CHECK (attempts > 0),
    last_error      TEXT          NOT NULL,
    first_failed_at TIMESTAMPTZ   NOT NULL DEFAULT now(),
    last_failed_at  TIMESTAMPTZ   NOT NULL DEFAULT now(),
    -- Set when the message was dead-lettered, with the reason label.
    dead_at         TIMESTAMPTZ,
    dead_reason     VARCHAR(255),
    PRIMARY KEY (message_id, consumer)
);

-- What `parcel-inbox dead` reads: dead rows, newest first. Partial, so it
-- stays as small as the dead-letter queues.
CREATE INDEX IF NOT EXISTS inbox_attempts_dead_idx
    ON inbox_attempts (dead_at)
    WHERE dead_at IS NOT NULL;

-- What cleanup scans: rows by the age of their last failure.
CREATE INDEX IF NOT EXISTS inbox_attempts_last_failed_at_idx
    ON inbox_attempts (last_failed_at);

COMMENT ON TABLE inbox_attempts IS
    'Failed deliveries per (message, consumer), written outside the rolled-back handler transaction; the delivery cap counts max(broker x-delivery-count, attempts). Purged with the inbox rows after the retention.';
