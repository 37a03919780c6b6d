-- The relay's take, as a function whose planner settings make it read
-- about its batch whatever the table's statistics say.
--
-- Why: an outbox fills in bursts. Right after one, ANALYZE has not seen
-- the new rows yet, the planner believes the table nearly empty, and it
-- planned the take as a bitmap scan of every pending row plus a sort,
-- instead of walking the pending index in order and stopping after the
-- batch: each take then read the whole backlog (1,025 buffers against 407
-- for a take of 100 from 20,000 fresh rows; at 40,000 pending a relay's
-- database used a full core). With fresh statistics the relay published
-- 0.96-1.05 times as fast as a bare publisher with confirms; with stale
-- ones about 0.55. A function's SET clauses hold only while it runs, so
-- nothing else in the session is affected.
--
-- What it does (inbox_postgres::sql::TAKE_PENDING selects from it): leases
-- the oldest due messages, in one statement and so one short transaction.
-- The inner SELECT walks the partial index of pending rows in enqueue
-- order, skips rows whose lease has not run out, and stops after `batch`;
-- FOR UPDATE SKIP LOCKED makes relays taking at the same moment skip each
-- other's rows instead of waiting for them or taking them twice. A row
-- another relay leased and committed in between is re-checked under its
-- lock (READ COMMITTED's re-evaluation) and left out, since its
-- locked_until now lies ahead. The UPDATE goes to the locked rows by
-- address (ctid), as the purges do: joined back on message_id instead, a
-- generic plan (which cannot see `batch`) hashed a sequential scan of the
-- whole table.
--
-- Idempotent (CREATE OR REPLACE), as every migration here.

CREATE OR REPLACE FUNCTION outbox_take(lease_ms float8, lease uuid, batch int8)
RETURNS SETOF outbox_messages
LANGUAGE sql VOLATILE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
UPDATE outbox_messages AS o
   SET locked_until = now() + lease_ms * interval '1 millisecond',
       lease_id = lease,
       attempts = o.attempts + 1
 WHERE o.ctid = ANY(ARRAY(
       SELECT ctid FROM outbox_messages
        WHERE published_at IS NULL
          AND (locked_until IS NULL OR locked_until <= now())
          AND dead_at IS NULL
          AND (next_attempt_at IS NULL OR next_attempt_at <= now())
        ORDER BY position
        LIMIT batch
          FOR UPDATE SKIP LOCKED))
RETURNING o.*
$$;
