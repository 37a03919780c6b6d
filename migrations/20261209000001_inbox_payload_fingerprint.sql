-- The fingerprint (SHA-256, 32 bytes) of the payload a claim was made for.
-- A later delivery under the same key whose payload has another fingerprint
-- is a producer reusing an id for another message, which the consumer is
-- told of instead of dropping it as a duplicate. Nullable: rows written
-- before this column, and claims made without a fingerprint, keep
-- deduplicating as they did. A new nullable column without a default is a
-- catalog change only in PostgreSQL 11+: no table rewrite, whatever the
-- table's size. On the partitioned layout it reaches every partition.
ALTER TABLE inbox_messages ADD COLUMN IF NOT EXISTS payload_fingerprint BYTEA;

COMMENT ON COLUMN inbox_messages.payload_fingerprint IS
    'SHA-256 of the payload the claim was made for; NULL when the consumer gave none (or the row predates 2026-12-09). A repeat of the key with another fingerprint is a conflict, not a duplicate.';
