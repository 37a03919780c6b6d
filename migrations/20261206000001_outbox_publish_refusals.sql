-- Per-message backoff and dead-lettering of outgoing messages the broker
-- refuses for their own sake (a nack, returned unroutable). Before this, a
-- message whose exchange had no binding came back every lease, forever.
--
-- Idempotent (ADD COLUMN IF NOT EXISTS), as every migration here.

ALTER TABLE outbox_messages
    -- Refusals of this message (not takes: an outage charges nothing).
    ADD COLUMN IF NOT EXISTS failures        INTEGER     NOT NULL DEFAULT 0,
    -- The broker's answer to the last refusal.
    ADD COLUMN IF NOT EXISTS last_error      TEXT,
    -- The backoff: relays do not take the row before this.
    ADD COLUMN IF NOT EXISTS next_attempt_at TIMESTAMPTZ,
    -- Set at the retry limit: the row is kept, never taken, not pending,
    -- until an operator requeues it.
    ADD COLUMN IF NOT EXISTS dead_at         TIMESTAMPTZ;

-- What `parcel-inbox outbox-dead` lists, newest first. Partial: dead rows
-- are rare.
CREATE INDEX IF NOT EXISTS outbox_messages_dead_at_idx
    ON outbox_messages (dead_at)
    WHERE dead_at IS NOT NULL;

COMMENT ON COLUMN outbox_messages.failures IS
    'Broker refusals (nack, returned) of this message; the backoff and the dead-letter limit count them.';
