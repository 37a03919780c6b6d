-- The inbox: one row per (message, consumer) whose claim committed.
--
-- Unqualified names on purpose: the backends pick the schema through
-- search_path, so tests and tenants can each have their own.
-- IF NOT EXISTS so that any runner may apply it over an existing schema.

CREATE TABLE IF NOT EXISTS inbox_messages (
    -- The producer's message id. Keyed together with the consumer: keyed on
    -- the id alone, a second consumer would skip its own work.
    id            UUID         NOT NULL,
    consumer_type VARCHAR(500) NOT NULL,
    received_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    -- Set in the same transaction as the claim, just before COMMIT.
    processed_at  TIMESTAMPTZ,
    PRIMARY KEY (id, consumer_type)
);

-- Cleanup runs `DELETE ... WHERE processed_at < $cutoff` in bounded batches.
-- This index serves exactly that predicate (the planner proves
-- `processed_at < x` implies `IS NOT NULL`), and stays small by leaving out
-- rows still in flight. A partial index on *unprocessed* rows, as in the
-- article this design starts from, cannot serve that delete.
CREATE INDEX IF NOT EXISTS inbox_messages_processed_at_idx
    ON inbox_messages (processed_at)
    WHERE processed_at IS NOT NULL;
