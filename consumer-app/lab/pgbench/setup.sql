-- The schema of the pgbench runs (run.sh): the inbox table as the migrations create it, and the benchmark's business table.
DROP SCHEMA IF EXISTS ratios_pgb CASCADE;
CREATE SCHEMA ratios_pgb;
SET search_path = ratios_pgb;
CREATE TABLE bench_events (message_id uuid NOT NULL, payload text NOT NULL);
CREATE TABLE inbox_messages (
    id uuid NOT NULL, consumer_type varchar(500) NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(), processed_at timestamptz,
    PRIMARY KEY (id, consumer_type));
CREATE INDEX inbox_messages_processed_at_idx ON inbox_messages (processed_at) WHERE processed_at IS NOT NULL;
