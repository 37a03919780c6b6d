-- The relay's take finds its table wherever it is called from.
--
-- Why: stores name the schema's objects qualified ("schema".outbox_take),
-- so that they work on a user's pool whose search_path is the user's, and
-- through PgBouncer in transaction mode, which keeps no session setting.
-- The function's body names outbox_messages unqualified, which PostgreSQL
-- resolves by the caller's search_path at call time. FROM CURRENT pins the
-- search_path the migration runs under (the runner sets it to the store's
-- schema for its transaction) as the function's own, for its calls only.
--
-- Idempotent: setting the same value again changes nothing.

ALTER FUNCTION outbox_take(float8, uuid, int8) SET search_path FROM CURRENT;
