-- The partitioned inbox layout (opt-in: `Layout::Partitioned`). Applied by
-- the runner before the migrations, and only to a schema without an inbox
-- table; the first migration's CREATE TABLE IF NOT EXISTS then finds this
-- one, and its processed_at index name already taken by the index below.
--
-- Deduplication stays exact because a message id maps to one partition
-- forever: the partition key is the id itself (plus a flag computed from
-- the id alone), never a time the claim reads from a clock.
--
-- - Ids whose version nibble is 7 (UUIDv7, RFC 9562) start with their
--   creation time in milliseconds, so a uuid range (byte order) is a time
--   range. They go to one partition per UTC day of their timestamp,
--   `inbox_messages_pYYYYMMDD`, created ahead of time by
--   inbox_create_partitions() and detached and dropped whole once the day
--   lies before the retention cutoff.
-- - Every other id (v4 and the rest: no time inside) goes to
--   `inbox_messages_untimed`, cleaned by bounded row deletes on
--   processed_at as in the plain layout. Routed by the version nibble, not
--   by range: a v4 id's random first 48 bits look like a timestamp.
-- - A v7 id with no partition (its day was dropped, or lies beyond the
--   precreated days) fails its INSERT with SQLSTATE 23514; the stores turn
--   that into `expired` (the day is past: the first copy may be gone, so
--   refuse) or a retryable error (the day is ahead: run maintenance).
--   There is deliberately no DEFAULT partition: it would accept an expired
--   id silently, and forbid DETACH ... CONCURRENTLY.

-- Whether `id` carries its time: version nibble 7 (the high half of
-- byte 6). IMMUTABLE, so the claim and the CHECK below agree forever.
CREATE OR REPLACE FUNCTION inbox_time_ordered(id uuid) RETURNS boolean
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN (get_byte(uuid_send(id), 6) >> 4) = 7;

-- The first uuid of the UTC day `day` in byte order: its 48-bit
-- millisecond timestamp, then zeros.
CREATE OR REPLACE FUNCTION inbox_day_start(day date) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN (lpad(to_hex((extract(epoch FROM day::timestamp) * 1000)::bigint), 12, '0')
            || '00000000000000000000')::uuid;

CREATE TABLE IF NOT EXISTS inbox_messages (
    id            UUID         NOT NULL,
    consumer_type VARCHAR(500) NOT NULL,
    received_at   TIMESTAMPTZ  NOT NULL DEFAULT now(),
    processed_at  TIMESTAMPTZ,
    -- A partition key must be a plain column (not a generated one), so the
    -- claim computes it; the CHECK holds every writer to the one rule.
    time_ordered  BOOLEAN      NOT NULL
        CONSTRAINT inbox_messages_time_ordered_check
        CHECK (time_ordered = inbox_time_ordered(id)),
    -- Must contain the partition key; time_ordered is a function of id,
    -- so this is as unique as (id, consumer_type).
    PRIMARY KEY (id, consumer_type, time_ordered)
) PARTITION BY RANGE (time_ordered, id);

CREATE TABLE IF NOT EXISTS inbox_messages_untimed PARTITION OF inbox_messages
    FOR VALUES FROM (false, MINVALUE) TO (true, MINVALUE);

-- Row cleanup only ever runs on the untimed partition: the day partitions
-- are dropped whole and need no index on processed_at.
CREATE INDEX IF NOT EXISTS inbox_messages_processed_at_idx
    ON inbox_messages_untimed (processed_at)
    WHERE processed_at IS NOT NULL;

-- Creates the day partitions from `days_behind` days before today (UTC)
-- to `days_ahead` days after it that are missing, and returns how many it
-- created. A day dropped since is not recreated unless it lies in that
-- window: run it with days_behind = 0 in production, so that an expired
-- day stays gone and its ids stay refused.
CREATE OR REPLACE FUNCTION inbox_create_partitions(days_behind integer, days_ahead integer)
    RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    day     date;
    created integer := 0;
BEGIN
    FOR day IN SELECT generate_series((now() AT TIME ZONE 'UTC')::date - days_behind,
                                      (now() AT TIME ZONE 'UTC')::date + days_ahead,
                                      interval '1 day')::date
    LOOP
        IF to_regclass(format('inbox_messages_p%s', to_char(day, 'YYYYMMDD'))) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF inbox_messages '
                           'FOR VALUES FROM (true, %L) TO (true, %L)',
                           format('inbox_messages_p%s', to_char(day, 'YYYYMMDD')),
                           inbox_day_start(day), inbox_day_start(day + 1));
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END $$;

COMMENT ON TABLE inbox_messages IS
    'Partitioned inbox layout: v7 ids by UTC day of their timestamp (inbox_messages_pYYYYMMDD, dropped whole after the retention), other ids in inbox_messages_untimed (row cleanup). Maintenance: SELECT inbox_create_partitions(0, 3).';

-- Yesterday (ids produced just before midnight) to three days ahead; a
-- fresh table has no history that accepting yesterday's ids could forget.
SELECT inbox_create_partitions(1, 3);
