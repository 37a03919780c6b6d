-- The response an idempotent HTTP endpoint answered the request that made
-- the claim with, kept in the claim's own transaction so that a retried
-- request (the same Idempotency-Key) is answered from it and does no work.
-- It lives and expires with the row: the inbox's cleanup removes both.
-- NULL for every claim that keeps no response (every message a consumer
-- handles). A new nullable column without a default is a catalog change
-- only in PostgreSQL 11+: no table rewrite, whatever the table's size. On
-- the partitioned layout it reaches every partition.
ALTER TABLE inbox_messages ADD COLUMN IF NOT EXISTS response BYTEA;

COMMENT ON COLUMN inbox_messages.response IS
    'The response an idempotent endpoint kept with its claim (encoded by the caller); NULL for claims that keep none. Deleted with the row.';
