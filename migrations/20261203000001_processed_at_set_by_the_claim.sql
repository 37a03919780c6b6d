-- Since this migration the claim's INSERT itself sets processed_at, and no
-- UPDATE follows it: the row is invisible until COMMIT, so a committed row
-- is a processed message, and the separate marking cost a round trip and a
-- non-HOT update per message. Two comments of the first migration predate
-- that: processed_at is no longer set "just before COMMIT", and claims still
-- in flight do have entries in inbox_messages_processed_at_idx. Applied
-- migrations are never edited (both runners compare checksums), so the
-- schema says it here, and in the catalog, where psql's \d+ shows it.
COMMENT ON COLUMN inbox_messages.processed_at IS
    'Set by the claim''s INSERT (transaction start time); the row commits with the consumer''s writes or not at all. NULL only in rows written before 2026-12-03. Cleanup deletes by it.';
